"""``ckptio.clean`` / ``ckptio clean``: what dead saves left in a folder.

A save writes into a temp file beside its target (``.NAME.ckptio-PID-NONCE.tmp``)
and holds a lock on it while it runs; a save that was killed leaves its temp
file unlocked. A multi-file save (DCP, sharded safetensors) that died or failed
before its ``.metadata`` or index may also leave data files that nothing names.
:func:`clean` removes both, using the temp files' locks as the liveness rule, in
any PID namespace: nothing while a save into the folder may still be running.

Data files go only where they carry the evidence of a dead ckptio save: the
names only ckptio gives (its token in them), or the files of a generation that
an index or ``.metadata`` ckptio committed replaced (older than it). Shards and
DCP data files of other writers that nothing names yet (a ``save_pretrained``
or torch's DCP writer before its index or ``.metadata``, a download in
progress) hold no lock ckptio sees, and stay; ``unreferenced=True`` (``ckptio
clean --unreferenced``) removes every data file nothing names, whoever wrote it,
as every ckptio save into the folder does first.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

from ckptio import _native
from ckptio.formats import dcp
from ckptio.formats import safetensors as st_format
from ckptio.io import remote


def clean(folder: str | os.PathLike[str], *, unreferenced: bool = False) -> list[str]:
    """Remove what dead saves left in ``folder``: temp files no live save holds, and
    the data files of DCP or sharded safetensors checkpoints that no ``.metadata``
    or index names and that a dead ckptio save left (its names, or a generation
    its commit replaced), while no save is in flight. ``unreferenced``: every
    data file that nothing names, whoever wrote it. The names removed."""
    path = os.fspath(folder)
    removed = list(_native.clean_temps(path))
    removed += dcp.sweep(path, unreferenced=unreferenced)
    removed += st_format.sweep(path, unreferenced=unreferenced)
    return removed


#: storage_options keys -> boto3 client arguments, for :func:`abort_uploads`.
_BOTO_ARGS = {
    "endpoint": "endpoint_url",
    "aws_endpoint": "endpoint_url",
    "access_key_id": "aws_access_key_id",
    "aws_access_key_id": "aws_access_key_id",
    "secret_access_key": "aws_secret_access_key",
    "aws_secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "token": "aws_session_token",
    "region": "region_name",
    "aws_region": "region_name",
}


def abort_uploads(
    url: str, older_than: float = 86400.0, storage_options: remote.StorageOptions = None
) -> list[str]:
    """Abort the multipart uploads under ``url`` (``s3://bucket/prefix``) begun
    more than ``older_than`` seconds ago (finite, >= 0: else a ValueError naming
    the URL): what saves killed midway leave in a store (invisible as objects,
    billed as storage). ``key (upload id)`` of each.
    ``url`` names a folder (``s3://b/run1`` is ``s3://b/run1/``: never the
    uploads of ``run10/`` or ``run1-eval/``) or one object (whose own uploads
    go too: ``s3://b/run1/model.pt``).

    The store's own rule does the same without a command (S3's
    ``AbortIncompleteMultipartUpload`` lifecycle rule; docs/objectstore.md).
    Needs boto3 (the core's client cannot list uploads).
    """
    remote.check_options(url, storage_options)
    if not url.startswith(("s3://", "s3a://")):
        raise ValueError(f"{url}: aborting dangling uploads needs an s3:// URL")
    # A negative age took the uploads of saves running now; NaN raised deep in datetime.
    if (
        isinstance(older_than, bool)
        or not isinstance(older_than, (int, float))
        or not 0 <= older_than < math.inf
    ):
        raise ValueError(
            f"{url}: older_than must be a finite number of seconds >= 0, not {older_than!r}"
        )
    try:
        import boto3
    except ImportError:
        raise ImportError(
            "ckptio clean s3://... lists dangling uploads with boto3: pip install boto3"
        ) from None
    bucket, prefix = remote.bucket_and_key(url)
    kwargs: dict[str, Any] = {}
    for key, value in (storage_options or {}).items():
        if key in _BOTO_ARGS:
            kwargs[_BOTO_ARGS[key]] = str(value)
    client = boto3.client("s3", **kwargs)
    try:
        cutoff = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
            seconds=older_than
        )
    except OverflowError:  # before year 1: no upload began that long ago
        return []
    aborted = []
    pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)
    folder = prefix if not prefix or prefix.endswith("/") else prefix + "/"

    def under(key: str) -> bool:  # in the folder, or the object the URL names
        return key.startswith(folder) or key == prefix

    for page in pages:
        for up in page.get("Uploads", []):
            if under(up["Key"]) and up["Initiated"] <= cutoff:
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                aborted.append(f"{up['Key']} ({up['UploadId']})")
    return aborted
