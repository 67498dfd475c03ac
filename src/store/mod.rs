//! Object storage (issue 38, first slice; feature `objectstore`): `s3://`,
//! `gs://` and `az://` objects as a sink and a source beside the file, over the
//! `object_store` crate. docs/objectstore.md is the design.
//!
//! - [`Store`]: one bucket (or container) and its client, made from a URL and
//!   the caller's options over the standard variables (`AWS_*`, `GOOGLE_*`,
//!   `AZURE_*`).
//! - [`MultipartSink`]: one object written as a multipart upload, its parts
//!   put in any order and in parallel (the part grid is the engine's chunk
//!   grid: [`part_grid`]); completing the upload is the commit, and an upload
//!   that is not committed is aborted.
//! - [`ObjectSource`]: one object read by ranged GETs, in parallel, straight
//!   into the caller's buffers, pinned to the version it opened.
//! - [`Store::put`]: a single PUT, conditional (If-None-Match, If-Match): the
//!   commit step of multi-object checkpoints (an index, `.metadata`).
//!
//! Every call blocks the calling thread on the process's one async runtime
//! ([`runtime`]), so the engine's lanes, which are plain threads, drive it.
//! Every failure is an [`Error::Store`] naming the URL, its kind typed
//! ([`StoreErrorKind`]) from what the client saw after its retries.

mod buffers;
mod runtime;
mod sink;
mod source;
mod transfer;

#[cfg(test)]
mod fault_proxy;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::{
    ObjectStore, ObjectStoreExt, ObjectStoreScheme, PutMode, PutOptions, RetryConfig, UpdateVersion,
};

use crate::error::StoreErrorKind;
use crate::{Error, Result};

pub use runtime::block_on;
pub use sink::MultipartSink;
pub use source::ObjectSource;
pub use transfer::{
    download_file, hash_ranges, read_segments, upload_file, upload_parts, upload_stream,
    SegmentsRead, StreamUpload, Transferred,
};

/// The smallest part ckptio uploads (S3 accepts 5 MiB; fewer, larger parts
/// cost fewer requests and stay under the part limit longer).
pub const MIN_PART: u64 = 16 << 20;
/// Parts of one upload are numbered below this (S3's 10,000 parts).
pub const MAX_PARTS: u64 = 10_000;
/// The largest part S3 accepts.
pub const MAX_PART: u64 = 5 << 30;

/// How an object of `total` bytes is cut into `count` parts: every part
/// `part_size` bytes but the last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartGrid {
    pub total: u64,
    pub part_size: u64,
    pub count: usize,
}

impl PartGrid {
    /// The byte range of part `idx`.
    pub fn range(&self, idx: usize) -> std::ops::Range<u64> {
        let start = (idx as u64).saturating_mul(self.part_size).min(self.total);
        start..start.saturating_add(self.part_size).min(self.total)
    }
}

/// The part grid of an object of `total` bytes written in chunks of `chunk`:
/// parts are whole chunks (so a lane's chunk never straddles two parts), at
/// least [`MIN_PART`], and fewer than [`MAX_PARTS`] of them. An empty object
/// is one empty part.
pub fn part_grid(total: u64, chunk: u64) -> Result<PartGrid> {
    if chunk == 0 {
        return Err(Error::invalid("the chunk size of a part grid must be > 0"));
    }
    let least = MIN_PART.max(total.div_ceil(MAX_PARTS - 1));
    let part_size = least
        .div_ceil(chunk)
        .checked_mul(chunk)
        .filter(|&p| p <= MAX_PART)
        .ok_or_else(|| {
            Error::invalid(format!(
                "an object of {total} bytes in chunks of {chunk} needs parts over 5 GiB"
            ))
        })?;
    let count = total.div_ceil(part_size).max(1) as usize;
    Ok(PartGrid {
        total,
        part_size,
        count,
    })
}

/// What a commit wrote over (the precondition of [`Store::put`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Precondition {
    /// Write whatever is there.
    None,
    /// Only if no object has the key (If-None-Match: *): a new checkpoint.
    Absent,
    /// Only if the object is still this version (If-Match): the next generation.
    Matches(Version),
}

/// One version of an object, as the store names it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Version {
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// What a HEAD says of an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    pub version: Version,
}

/// A bucket (or container) and the client that reaches it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    /// `scheme://bucket`, to name objects in errors.
    base: String,
    /// The process that made the client: its connections belong to that
    /// process's runtime, so a forked child may not use it (nor abort its
    /// uploads).
    pid: u32,
    objects: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("base", &self.base)
            .field("objects", &self.objects)
            .finish()
    }
}

/// Options ckptio reads itself; every other option goes to the client.
const MAX_RETRIES: &str = "max_retries";
const RETRY_TIMEOUT: &str = "retry_timeout";

impl Store {
    /// The store of `url` (`s3://bucket/key`, `gs://...`, `az://...` and the
    /// https forms `object_store` knows) and the object key it names.
    ///
    /// Configuration is read from the standard variables, then `options`
    /// (`object_store`'s keys, e.g. `endpoint`, `aws_access_key_id`,
    /// `region`) override it; `max_retries` and `retry_timeout` (seconds) set
    /// the retry budget. An `http://` endpoint is accepted (a local server).
    pub fn parse(url: &str, options: &[(&str, &str)]) -> Result<(Store, String)> {
        let (scheme, key) = Store::parse_key(url)?;
        let mut retry = RetryConfig::default();
        let mut rest = Vec::new();
        for &(k, v) in options {
            match k {
                MAX_RETRIES => retry.max_retries = parse_option(url, k, v)?,
                RETRY_TIMEOUT => retry.retry_timeout = parse_seconds(url, k, v)?,
                _ => rest.push((k, v)),
            }
        }
        let built = match scheme {
            ObjectStoreScheme::AmazonS3 => {
                let mut b = s3_builder(url, &config_keys::<AmazonS3ConfigKey>(url, &rest)?);
                if plain_http(b.get_config_value(&AmazonS3ConfigKey::Endpoint).as_deref()) {
                    b = b.with_allow_http(true);
                }
                b.with_retry(retry).build().map(clients)
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                let opts = config_keys::<GoogleConfigKey>(url, &rest)?;
                let mut b = GoogleCloudStorageBuilder::new();
                let drop = |k: &GoogleConfigKey| other_credential(k, &opts, gcs_credential);
                if !drop(&GoogleConfigKey::ServiceAccount) {
                    // As GoogleCloudStorageBuilder::from_env reads it.
                    if let Ok(path) = std::env::var("SERVICE_ACCOUNT") {
                        b = b.with_service_account_path(path);
                    }
                }
                for (key, v) in env_config::<GoogleConfigKey>("GOOGLE_", drop) {
                    b = b.with_config(key, v);
                }
                b = b.with_url(url);
                for (key, v) in opts {
                    b = b.with_config(key, v);
                }
                b.with_retry(retry).build().map(clients)
            }
            ObjectStoreScheme::MicrosoftAzure => {
                let opts = config_keys::<AzureConfigKey>(url, &rest)?;
                let mut b = MicrosoftAzureBuilder::new();
                let drop = |k: &AzureConfigKey| other_credential(k, &opts, azure_credential);
                for (key, v) in env_config::<AzureConfigKey>("AZURE_", drop) {
                    b = b.with_config(key, v);
                }
                // As MicrosoftAzureBuilder::from_env reads it.
                if let Ok(text) = std::env::var("IDENTITY_ENDPOINT") {
                    b = b.with_msi_endpoint(text);
                }
                b = b.with_url(url);
                for (key, v) in opts {
                    b = b.with_config(key, v);
                }
                b.with_retry(retry).build().map(clients)
            }
            _ => {
                return Err(Error::invalid(format!(
                    "{url}: not an s3://, gs:// or az:// URL"
                )))
            }
        };
        let (objects, multipart) = built.map_err(|e| store_error(url, e))?;
        let store = Store {
            inner: Arc::new(Inner {
                base: Store::base(url, &key),
                pid: std::process::id(),
                objects,
                multipart,
            }),
        };
        Ok((store, key))
    }

    /// The scheme of `url` and the object key it names (no client is made).
    ///
    /// In `s3://bucket/key` (and `gs://`, `az://`) the key is taken as
    /// written, as the AWS CLI and boto3 take it: a `%`, `#`, `?` or non-ASCII
    /// character is part of the key, not a URL escape, query or fragment. The
    /// https forms are URLs: their path is percent-decoded.
    pub fn parse_key(url: &str) -> Result<(ObjectStoreScheme, String)> {
        let parsed =
            url::Url::parse(url).map_err(|e| Error::invalid(format!("{url}: not a URL: {e}")))?;
        let (scheme, path) = ObjectStoreScheme::parse(&parsed)
            .map_err(|e| Error::invalid(format!("{url}: not an object-store URL: {e}")))?;
        let literal = match parsed.scheme() {
            "http" | "https" => None,
            _ => url
                .split_once("://")
                .map(|(_, rest)| rest.split_once('/').map_or("", |(_, key)| key)),
        };
        let key = match literal {
            Some(raw) => Path::parse(raw),
            None => Ok(path),
        }
        .map_err(|e| Error::invalid(format!("{url}: not a valid key: {e}")))?
        .to_string();
        Ok((scheme, key))
    }

    /// What comes before the key in `url` (which names `key`): `s3://bucket`
    /// (`gs://`, `az://`: the scheme and the bucket as written, whatever the
    /// key's form: `s3://b/run/` and `s3://b/run` have the same), or the https
    /// URL less the key's path. The same for every URL of one bucket: a client
    /// made for one of them serves the others.
    pub fn base(url: &str, key: &str) -> String {
        if let Some((scheme, rest)) = url.split_once("://") {
            if !matches!(scheme, "http" | "https") {
                let bucket = rest.split('/').next().unwrap_or("");
                return format!("{scheme}://{bucket}");
            }
        }
        let url = url.trim_end_matches('/');
        url[..url.len() - url_tail(url, key)]
            .trim_end_matches('/')
            .to_string()
    }

    /// The URL of `key` in this store (for messages).
    pub fn url(&self, key: &str) -> String {
        format!("{}/{key}", self.inner.base)
    }

    /// Refused in a process other than the one that made the store.
    fn this_process(&self) -> Result<()> {
        if self.inner.pid == std::process::id() {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{}: a store made before a fork is not used after it: make one in this process",
                self.inner.base
            )))
        }
    }

    pub(crate) fn objects(&self) -> Result<&Arc<dyn ObjectStore>> {
        self.this_process()?;
        Ok(&self.inner.objects)
    }

    pub(crate) fn multipart(&self) -> Result<&Arc<dyn MultipartStore>> {
        self.this_process()?;
        Ok(&self.inner.multipart)
    }

    /// Size and version of `key`.
    pub fn head(&self, key: &str) -> Result<ObjectInfo> {
        self.not_the_bucket(key)?;
        let path = object_path(key);
        let meta = match block_on(self.objects()?.head(&path))? {
            Ok(meta) => meta,
            Err(e) => return Err(self.head_error(key, &path, e)),
        };
        Ok(ObjectInfo {
            size: meta.size,
            version: Version {
                e_tag: meta.e_tag,
                version: meta.version,
            },
        })
    }

    /// Write `data` to `key` in one PUT, atomically, if `pre` holds (else a
    /// [`StoreErrorKind::Conflict`]); the new version.
    pub fn put(&self, key: &str, data: Bytes, pre: Precondition) -> Result<Version> {
        self.an_object(key)?;
        let mode = match pre {
            Precondition::None => PutMode::Overwrite,
            Precondition::Absent => PutMode::Create,
            Precondition::Matches(v) => PutMode::Update(UpdateVersion {
                e_tag: v.e_tag,
                version: v.version,
            }),
        };
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let path = object_path(key);
        let r = block_on(self.objects()?.put_opts(&path, data.into(), opts))?
            .map_err(|e| self.error(key, e))?;
        Ok(Version {
            e_tag: r.e_tag,
            version: r.version,
        })
    }

    /// The whole of a small object (an index, a commit record) and its version,
    /// in one GET.
    pub fn get(&self, key: &str) -> Result<(Bytes, Version)> {
        self.not_the_bucket(key)?;
        let path = object_path(key);
        let fetched = block_on(async {
            let r = self.objects()?.get(&path).await;
            let r = match r {
                Ok(r) => r,
                Err(e) => return Err(self.error(key, e)),
            };
            let version = Version {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            let data = r.bytes().await.map_err(|e| self.error(key, e))?;
            Ok((data, version))
        })?;
        fetched
    }

    /// Every object under the folder `prefix` (all depths): key, size, ETag,
    /// and the store's time of its last change (seconds since the epoch; for
    /// a multipart upload, S3 gives the time it began).
    ///
    /// Folder markers (empty objects whose key ends in `/`, as the S3
    /// console's "Create folder" and many tools make) are not objects of the
    /// folder: the client gives their key with the `/` taken off, so the
    /// marker of `prefix` itself and an empty object that other listed keys
    /// lie under are left out. (A marker of an empty subfolder cannot be told
    /// from an empty object here: `remote.local_tree` HEADs those.)
    pub fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        let path = object_path(prefix);
        let listed = block_on(async {
            let objects = self.objects()?;
            let mut out = Vec::new();
            let mut stream = objects.list(Some(&path));
            while let Some(meta) = stream.next().await {
                let meta = meta.map_err(|e| self.error(prefix, e))?;
                if meta.location == path {
                    continue; // the folder's own marker
                }
                let modified = meta.last_modified.timestamp_millis() as f64 / 1000.0;
                out.push((meta.location.to_string(), meta.size, meta.e_tag, modified));
            }
            Ok(out)
        })?;
        listed.map(without_folder_markers)
    }

    /// Remove `key` (a key that is not there is not an error on S3).
    pub fn delete(&self, key: &str) -> Result<()> {
        self.an_object(key)?;
        let path = object_path(key);
        block_on(self.objects()?.delete(&path))?.map_err(|e| self.error(key, e))
    }

    /// An empty key names the bucket, a folder: no object has it (a HEAD of
    /// it is the bucket's, answered 200 with no size; a GET of it a listing).
    /// The error a missing object gives, so that a caller that falls back to
    /// the folder's listing does so.
    pub(crate) fn not_the_bucket(&self, key: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::Store {
                kind: StoreErrorKind::NoSuchKey,
                url: self.inner.base.clone(),
                reason: "names the bucket, not an object (no key)".to_string(),
            });
        }
        Ok(())
    }

    /// Refused for an empty key: a PUT, DELETE or upload of it would be the
    /// bucket's own (CreateBucket, DeleteBucket).
    pub(crate) fn an_object(&self, key: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::invalid(format!(
                "{}: names the bucket, not an object: give the object's key",
                self.inner.base
            )));
        }
        Ok(())
    }

    /// A HEAD's 404 has no body to tell a missing bucket from a missing
    /// key: a LIST of the key (whose 404 has one) tells them apart.
    fn head_error(&self, key: &str, path: &Path, e: object_store::Error) -> Error {
        let err = self.error(key, e);
        if let Error::Store {
            kind: StoreErrorKind::NoSuchKey,
            ..
        } = &err
        {
            let listed = block_on(async { self.inner.objects.list(Some(path)).next().await });
            if let Ok(Some(Err(e))) = listed {
                if classify(&e) == StoreErrorKind::NoSuchBucket {
                    return self.error(key, e);
                }
            }
        }
        err
    }

    pub(crate) fn error(&self, key: &str, e: object_store::Error) -> Error {
        store_error(&self.url(key), e)
    }
}

type Clients = (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>);

/// One client seen as both traits the store uses.
fn clients<S: ObjectStore + MultipartStore>(s: S) -> Clients {
    let s = Arc::new(s);
    (s.clone(), s)
}

/// The S3 client of `url`: the environment's `AWS_*` variables (as
/// `AmazonS3Builder::from_env` reads them), then `opts` over them. Where `opts`
/// give an access key or a secret, the environment's session token is not
/// taken unless `opts` give one too: a token belongs to the keys it was issued
/// with, and one sent with other keys is refused (access denied).
///
/// Unless either says, a request's body goes unsigned (`UNSIGNED-PAYLOAD`)
/// over TLS (AWS's own endpoint, an `https://` one), as the AWS SDKs do: TLS
/// already protects it, and a SHA-256 of every byte costs the client CPU the
/// transfer needs (0.6 CPU-s per GiB saved on the development VM). Over plain
/// `http://` it stays signed: nothing else covers it there.
fn s3_builder(url: &str, opts: &[(AmazonS3ConfigKey, &str)]) -> AmazonS3Builder {
    use AmazonS3ConfigKey as K;
    let given = |k: &K| opts.iter().any(|(o, _)| o == k);
    let own_keys = given(&K::AccessKeyId) || given(&K::SecretAccessKey);
    let drop = |k: &K| own_keys && *k == K::Token && !given(&K::Token);
    let env = env_config::<K>("AWS_", drop);
    let signing_said =
        given(&K::UnsignedPayload) || env.iter().any(|(k, _)| *k == K::UnsignedPayload);
    let mut b = AmazonS3Builder::new();
    for (key, v) in env {
        b = b.with_config(key, v);
    }
    b = b.with_url(url);
    for (key, v) in opts {
        b = b.with_config(*key, *v);
    }
    if !signing_said && !plain_http(b.get_config_value(&K::Endpoint).as_deref()) {
        b = b.with_unsigned_payload(true);
    }
    b
}

/// Whether an S3 endpoint is plain `http://` (a local server, say): the
/// client must be let use it, and its bodies stay signed.
fn plain_http(endpoint: Option<&str>) -> bool {
    endpoint.is_some_and(|e| {
        e.get(..7)
            .is_some_and(|p| p.eq_ignore_ascii_case("http://"))
    })
}

/// The client's keys of the environment's variables named `prefix...` (as the
/// builders' `from_env` read them), less those `drop` names.
fn env_config<K: std::str::FromStr>(prefix: &str, drop: impl Fn(&K) -> bool) -> Vec<(K, String)> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .filter(|(k, _)| k.starts_with(prefix))
        .filter_map(|(k, v)| Some((k.to_ascii_lowercase().parse::<K>().ok()?, v)))
        .filter(|(k, _)| !drop(k))
        .collect()
}

/// Whether the environment's key `k` is a credential of another kind than
/// those `opts` give (`kind` sorts the credential keys): the credentials of
/// `opts` then replace the environment's, which the client would otherwise
/// prefer by its own order (a bearer token over an account key, a service
/// account over application credentials).
fn other_credential<K: PartialEq>(k: &K, opts: &[(K, &str)], kind: fn(&K) -> Option<u8>) -> bool {
    let given: Vec<u8> = opts.iter().filter_map(|(o, _)| kind(o)).collect();
    match kind(k) {
        Some(c) => !given.is_empty() && !given.contains(&c),
        None => false,
    }
}

fn azure_credential(k: &AzureConfigKey) -> Option<u8> {
    match k {
        AzureConfigKey::AccessKey => Some(0),
        AzureConfigKey::ClientSecret => Some(1),
        AzureConfigKey::SasKey => Some(2),
        AzureConfigKey::Token => Some(3),
        _ => None,
    }
}

fn gcs_credential(k: &GoogleConfigKey) -> Option<u8> {
    match k {
        GoogleConfigKey::ServiceAccount => Some(0),
        GoogleConfigKey::ServiceAccountKey => Some(1),
        GoogleConfigKey::ApplicationCredentials => Some(2),
        GoogleConfigKey::BearerToken => Some(3),
        _ => None,
    }
}

/// The client's configuration keys of `options` (an unknown one is an error).
fn config_keys<'a, K: std::str::FromStr>(
    url: &str,
    options: &[(&str, &'a str)],
) -> Result<Vec<(K, &'a str)>> {
    options
        .iter()
        .map(|&(k, v)| {
            k.parse()
                .map(|key| (key, v))
                .map_err(|_| Error::invalid(format!("{url}: unknown storage option {k:?}")))
        })
        .collect()
}

fn parse_option<T: std::str::FromStr>(url: &str, key: &str, value: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| Error::invalid(format!("{url}: bad value {value:?} for {key}")))
}

/// `listed` less the empty objects that other listed keys lie under: folder
/// markers (`run/notes/` listed as `run/notes` beside `run/notes/a`).
fn without_folder_markers(mut listed: Vec<Listed>) -> Vec<Listed> {
    let folders: std::collections::HashSet<&str> = listed
        .iter()
        .flat_map(|(key, ..)| {
            key.char_indices()
                .filter(|&(_, c)| c == '/')
                .map(move |(i, _)| &key[..i])
        })
        .collect();
    let markers: std::collections::HashSet<String> = listed
        .iter()
        .filter(|(key, size, ..)| *size == 0 && folders.contains(key.as_str()))
        .map(|(key, ..)| key.clone())
        .collect();
    listed.retain(|(key, ..)| !markers.contains(key));
    listed
}

/// A duration option given in seconds: a finite number >= 0 that a
/// [`Duration`] holds (a negative, NaN, infinite or too large one is an
/// invalid value naming the URL and the option, not a panic).
fn parse_seconds(url: &str, key: &str, value: &str) -> Result<Duration> {
    let secs: f64 = parse_option(url, key, value)?;
    Duration::try_from_secs_f64(secs).map_err(|_| {
        Error::invalid(format!(
            "{url}: bad value {value:?} for {key}: a finite number of seconds >= 0 \
             (at most {}) is expected",
            u64::MAX
        ))
    })
}

/// How many bytes at the end of `url` spell `key` (0 when they don't).
/// The object_store path of a key as given (checked by [`Store::parse_key`],
/// or listed by the store): never escaped again, so the stored key is the
/// one in the URL (`Path::from` would escape `%`, non-ASCII and more).
/// An object of a listing: key, size, ETag, time of its last change.
pub type Listed = (String, u64, Option<String>, f64);

pub(crate) fn object_path(key: &str) -> Path {
    Path::parse(key).unwrap_or_else(|_| Path::from(key))
}

fn url_tail(url: &str, key: &str) -> usize {
    if !key.is_empty() && url.ends_with(key) {
        key.len()
    } else {
        0
    }
}

/// The typed error of a failed request on `url`.
pub(crate) fn store_error(url: &str, e: object_store::Error) -> Error {
    let kind = classify(&e);
    let reason = if kind == StoreErrorKind::NoCredentials && from_metadata_service(&chain(&e)) {
        format!(
            "none in storage_options or the environment's variables, and none from the \
             instance or container metadata service ({})",
            chain(&e)
        )
    } else {
        chain(&e)
    };
    Error::Store {
        kind,
        url: url.to_string(),
        reason,
    }
}

/// Whether a failed request was the client's fetch of credentials from the
/// instance or container metadata service (AWS IMDS and ECS, GCP, Azure): the
/// client goes there when no credentials were given.
fn from_metadata_service(text: &str) -> bool {
    [
        "/latest/api/token",
        "/latest/meta-data/iam",
        "169.254.170.2",
        "computeMetadata/",
        "/metadata/identity/oauth2/token",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// The kind of a client error, from its variant, then from the HTTP status or
/// the connection failure behind it.
fn classify(e: &object_store::Error) -> StoreErrorKind {
    use object_store::Error as E;
    let text = chain(e);
    match e {
        E::NotFound { .. } if text.contains("NoSuchBucket") => StoreErrorKind::NoSuchBucket,
        E::NotFound { .. } => StoreErrorKind::NoSuchKey,
        E::Precondition { .. } | E::AlreadyExists { .. } => StoreErrorKind::Conflict,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => StoreErrorKind::AccessDenied,
        _ if from_metadata_service(&text) => StoreErrorKind::NoCredentials,
        _ => {
            // The client's retry error, which holds the HTTP status, is not
            // public: its status is read from its text, "status code: 503".
            let status = text
                .split("status code: ")
                .nth(1)
                .and_then(|t| t.get(..3))
                .and_then(|t| t.parse::<u16>().ok());
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
            while let Some(err) = cur {
                if err
                    .downcast_ref::<object_store::client::HttpError>()
                    .is_some()
                {
                    return StoreErrorKind::ConnectionLost;
                }
                cur = err.source();
            }
            match status {
                Some(503 | 429) => StoreErrorKind::Throttled,
                _ if text.contains("SlowDown") => StoreErrorKind::Throttled,
                Some(401 | 403) => StoreErrorKind::AccessDenied,
                Some(404) if text.contains("NoSuchBucket") => StoreErrorKind::NoSuchBucket,
                Some(404) => StoreErrorKind::NoSuchKey,
                Some(409 | 412) => StoreErrorKind::Conflict,
                Some(_) => StoreErrorKind::Other,
                None if text.to_ascii_lowercase().contains("credential") => {
                    StoreErrorKind::NoCredentials
                }
                None => StoreErrorKind::Other,
            }
        }
    }
}

/// An error and its sources, one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let t = err.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = err.source();
    }
    s
}
