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
//! - Every change of the replicas' key, from a reload or from a change on disk, goes through
//!   [`ReplicaKeyFile`]'s lock, so that neither overwrites the other's newer key.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::HeaderValue;
use kvroute_proto::serve::{FromFiles, Watched};
use tokio_util::sync::CancellationToken;

use super::live::Live;

/// The key file in use, if any, and its key. Clones share them.
#[derive(Clone, Debug)]
pub struct ReplicaKeyFile {
    made: Watched<Key>,
    /// Held across each change of the file and of the key sent.
    turn: Arc<Mutex<()>>,
}

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
        Ok(Self { made: Watched::from_files(&path.map(Path::to_owned))?, turn: Arc::default() })
    }

    /// The `Authorization` value of the file's key, if a file is named.
    pub fn authorization(&self) -> Option<HeaderValue> {
        self.made.get().0
    }

    /// Puts a reloaded configuration's key in place (`replicas`): that of the file at `path`,
    /// read again (if it cannot be loaded, the key in use stays, whichever it was), or without a
    /// file `flag` (`--replica-api-key`'s, or none). Whether the file was loaded, if one is
    /// named.
    pub fn apply(
        &self,
        path: Option<&Path>,
        flag: Option<HeaderValue>,
        replicas: &Live<Option<HeaderValue>>,
    ) -> Option<Result<(), String>> {
        let _turn = self.turn.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(path) = path else {
            if self.made.files().is_some() {
                // No file followed from now on (nothing to read: it cannot fail).
                drop(self.made.load(&None));
            }
            replicas.set(flag);
            return None;
        };
        let loaded = self.made.load(&Some(path.to_owned()));
        if loaded.is_ok() {
            replicas.set(self.authorization());
        }
        Some(loaded)
    }

    /// Loads since the start, done and refused; `None` while no file is named.
    pub fn loads(&self) -> Option<(u64, u64)> {
        self.made.files().is_some().then(|| self.made.loads())
    }

    /// Checks the file every `period` until `shutdown` fires, sending a changed key from then
    /// on (`replicas`); logs each change loaded or refused.
    pub async fn watch(
        self,
        replicas: Live<Option<HeaderValue>>,
        period: Duration,
        shutdown: CancellationToken,
    ) {
        kvroute_proto::serve::every(period, shutdown, || {
            let _turn = self.turn.lock().unwrap_or_else(PoisonError::into_inner);
            self.reload_if_changed(&replicas);
        })
        .await;
    }

    /// Loads the file again if what it holds changed, and sends its key from then on; logs
    /// the change loaded or refused.
    fn reload_if_changed(&self, replicas: &Live<Option<HeaderValue>>) {
        match self.made.reload_if_changed() {
            None => {}
            Some(Ok(())) => {
                replicas.set(self.authorization());
                tracing::info!("--replica-api-key-file changed on disk: its key is sent from now on");
            }
            Some(Err(why)) => {
                tracing::warn!(error = %why, "--replica-api-key-file changed on disk and cannot be loaded; the key in use stays");
            }
        }
    }
}
