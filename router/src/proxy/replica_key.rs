//! The replicas' key from a file (`--replica-api-key-file`), in place of `--replica-api-key`:
//! a Kubernetes Secret mounted as a volume, the one the replicas' own `--api-key` comes from,
//! so that the router sends the new key as soon as the kubelet writes it.
//!
//! - The file holds one key (blanks around it, a `#` comment, are left out, as in
//!   `--api-key-file`).
//! - It is read at the start (a file that cannot be read, or does not hold one key, stops the
//!   start with the other configuration errors), at each `SIGHUP`, and whenever what it holds
//!   changes (checked every `--api-key-check-ms`): the requests forwarded from then on carry
//!   the new key, as do the router's own ([`super::control`]).
//! - A file that can no longer be read, or no longer holds one key, keeps the key in use.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderValue;
use kvroute_proto::serve::{FromFiles, Watched};
use tokio_util::sync::CancellationToken;

use super::live::Live;

/// The key file in use, if any, and its key.
#[derive(Clone, Debug)]
pub struct ReplicaKeyFile(Watched<Key>);

/// A file's key as an `Authorization` value (`None` without a file).
#[derive(Clone, Debug)]
struct Key(Option<HeaderValue>);

impl FromFiles for Key {
    type Files = Option<PathBuf>;

    fn paths(path: &Option<PathBuf>) -> Vec<&Path> {
        path.iter().map(PathBuf::as_path).collect()
    }

    fn make(path: &Option<PathBuf>, contents: &[Vec<u8>]) -> Result<Self, String> {
        let (Some(path), Some(contents)) = (path, contents.first()) else { return Ok(Key(None)) };
        match super::key_file::parse(path, contents)?.as_slice() {
            [key] => crate::config::bearer(key)
                .map(|value| Key(Some(value)))
                .ok_or_else(|| format!("{}: not a key an HTTP header can carry", path.display())),
            keys => Err(format!("{}: holds {} keys; the replicas' key is one", path.display(), keys.len())),
        }
    }
}

impl ReplicaKeyFile {
    /// The key in the file at `path` (none without one), or what is wrong with it.
    pub fn open(path: Option<&Path>) -> Result<Self, String> {
        Watched::from_files(&path.map(Path::to_owned)).map(Self)
    }

    /// The `Authorization` value of the file's key, if a file is named.
    pub fn authorization(&self) -> Option<HeaderValue> {
        self.0.get().0
    }

    /// Reads the file at `path` (at a reload) and, if one is named, sends its key from now on
    /// (`replicas`); on an error the key in use stays. Without a file, `replicas` is left to
    /// `--replica-api-key`.
    pub fn load(&self, path: Option<&Path>, replicas: &Live<Option<HeaderValue>>) -> Result<(), String> {
        self.0.load(&path.map(Path::to_owned))?;
        if path.is_some() {
            replicas.set(self.authorization());
        }
        Ok(())
    }

    /// Loads since the start, done and refused; `None` while no file is named.
    pub fn loads(&self) -> Option<(u64, u64)> {
        self.0.files().is_some().then(|| self.0.loads())
    }

    /// Checks the file every `period` until `shutdown` fires, sending a changed key from then
    /// on (`replicas`); logs each change loaded or refused.
    pub async fn watch(
        self,
        replicas: Live<Option<HeaderValue>>,
        period: Duration,
        shutdown: CancellationToken,
    ) {
        kvroute_proto::serve::every(period, shutdown, || match self.0.reload_if_changed() {
            None => {}
            Some(Ok(())) => {
                replicas.set(self.authorization());
                tracing::info!("--replica-api-key-file changed on disk: its key is sent from now on");
            }
            Some(Err(why)) => {
                tracing::warn!(error = %why, "--replica-api-key-file changed on disk and cannot be loaded; the key in use stays");
            }
        })
        .await;
    }
}
