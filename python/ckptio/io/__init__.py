"""The I/O layer: how bytes move between tensor memory and files.

- :mod:`.engines`: the engine knobs of a call (:class:`IoOptions`) and the
  engines cached per configuration;
- :mod:`.transfer`: the one way to the native core (segments, owners, the
  caller's CUDA streams), reads of several files at once;
- :mod:`.reports`: what a save or load did (:class:`IOReport`, ``last_report()``);
- :mod:`.memory`: fresh host memory (huge pages), storages allocated empty on
  their device, the CUDA cache reservation;
- :mod:`.devices`: device codes, streams, where a ``map_location`` puts a storage;
- :mod:`.paths`: file arguments (paths, file objects), paths confined to a folder;
- :mod:`.units`: byte sizes written as text.

It knows no checkpoint format; the formats layer above builds segments.
"""

from ckptio.io import cufile_log

# Before anything of ckptio loads libcufile: its log goes to ckptio's cache folder.
cufile_log.point_log()
