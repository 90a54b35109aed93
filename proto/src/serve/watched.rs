//! A value made from files (a TLS certificate and its key, a client's authorities), made again
//! in place when asked ([`Watched::load`], a reload) and whenever what the files hold changes
//! ([`Watched::watch`]: cert-manager renewing a mounted Secret, with nobody to send a signal).
//! A change that cannot be made into a value leaves the one in use, and is not tried again
//! until the files change again.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::read_file;

/// What can be made from files' contents.
pub trait FromFiles: Clone + Send + Sync + 'static {
    /// Which files.
    type Files: Clone + PartialEq + std::fmt::Debug + Send + Sync + 'static;
    /// What is read of them: the files [`FromFiles::make`] is given the contents of, in order.
    fn paths(files: &Self::Files) -> Vec<&Path>;
    /// The value of `files`, which hold `contents` (one for each of their [`FromFiles::paths`]);
    /// else what is wrong, naming the file.
    fn make(files: &Self::Files, contents: &[Vec<u8>]) -> Result<Self, String>;

    /// The value of what `files` hold now, read once (not watched).
    fn read_once(files: &Self::Files) -> Result<Self, String> {
        Self::make(files, &read::<Self>(files)?)
    }
}

/// A value made from files, as last made. Clones share it.
pub struct Watched<T: FromFiles>(Arc<Shared<T>>);

impl<T: FromFiles> Clone for Watched<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

struct Shared<T: FromFiles> {
    loaded: RwLock<Loaded<T>>,
    /// Loads since the start (at a reload, or of a change on disk): done, and refused.
    loads: [AtomicU64; 2],
    /// Bumped at each value made after the first.
    generation: AtomicU64,
}

struct Loaded<T: FromFiles> {
    value: T,
    files: T::Files,
    /// The files' contents last read, made or not: a change is made (or refused) once.
    seen: Vec<Vec<u8>>,
    /// Why `seen` could not be made into a value, if it could not.
    refused: Option<String>,
}

/// What each of `files` holds now; else which one cannot be read, and why.
fn read<T: FromFiles>(files: &T::Files) -> Result<Vec<Vec<u8>>, String> {
    T::paths(files).into_iter().map(read_file).collect()
}

impl<T: FromFiles> Watched<T> {
    /// The value of `files`; what is wrong with one of them, else.
    pub fn from_files(files: &T::Files) -> Result<Self, String> {
        let seen = read::<T>(files)?;
        let value = T::make(files, &seen)?;
        let loaded = RwLock::new(Loaded { value, files: files.clone(), seen, refused: None });
        Ok(Self(Arc::new(Shared { loaded, loads: Default::default(), generation: AtomicU64::new(0) })))
    }

    /// The value in use.
    pub fn get(&self) -> T {
        self.0.loaded.read().unwrap_or_else(PoisonError::into_inner).value.clone()
    }

    /// How many values were made since the first: what was made with an older one is stale.
    pub fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::Acquire)
    }

    /// The files in use.
    pub fn files(&self) -> T::Files {
        self.0.loaded.read().unwrap_or_else(PoisonError::into_inner).files.clone()
    }

    /// Makes the value of what `files` hold now, and watches those files from then on. On an
    /// error the value in use stays. (A check of the files under way meanwhile may have read
    /// newer contents than this did: the next check loads them.)
    pub fn load(&self, files: &T::Files) -> Result<(), String> {
        let made = read::<T>(files).and_then(|seen| Ok((T::make(files, &seen)?, seen)));
        self.count(&made);
        let (value, seen) = made?;
        *self.0.loaded.write().unwrap_or_else(PoisonError::into_inner) =
            Loaded { value, files: files.clone(), seen, refused: None };
        self.0.generation.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// Loads since the start, at a reload or of a change on disk: how many were done, and how
    /// many refused (a file that could not be read or made into a value; the one in use
    /// stayed).
    pub fn loads(&self) -> (u64, u64) {
        let [done, refused] = &self.0.loads;
        (done.load(Ordering::Relaxed), refused.load(Ordering::Relaxed))
    }

    fn count<R>(&self, made: &Result<R, String>) {
        self.0.loads[usize::from(made.is_err())].fetch_add(1, Ordering::Relaxed);
    }

    /// Makes the value again if what the files hold changed since they were last read: `None`
    /// if it did not (or a reload read them meanwhile), else whether it could be made (if not,
    /// the value in use stays, and the same contents are not tried again).
    pub fn reload_if_changed(&self) -> Option<Result<(), String>> {
        let (files, seen) = {
            let loaded = self.0.loaded.read().unwrap_or_else(PoisonError::into_inner);
            (loaded.files.clone(), loaded.seen.clone())
        };
        let now = read::<T>(&files);
        if now.as_ref().is_ok_and(|now| *now == seen) {
            return None;
        }
        let now = match now {
            Ok(now) => now,
            Err(why) => return Some(Err(why)).inspect(|made| self.count(made)),
        };
        let made = T::make(&files, &now);
        let mut loaded = self.0.loaded.write().unwrap_or_else(PoisonError::into_inner);
        // Not if a reload loaded other files meanwhile, or the same ones anew: what it read
        // may be newer than what this read.
        if loaded.files != files || loaded.seen != seen {
            return None;
        }
        let made = made.map(|value| {
            loaded.value = value;
            self.0.generation.fetch_add(1, Ordering::Release);
        });
        loaded.seen = now;
        loaded.refused = made.as_ref().err().cloned();
        self.count(&made);
        Some(made)
    }

    /// Why what the files held when last read could not be made into a value (the one in use
    /// is older), if it could not.
    pub fn refused(&self) -> Option<String> {
        self.0.loaded.read().unwrap_or_else(PoisonError::into_inner).refused.clone()
    }

    /// Checks the files every `period` until `shutdown` fires ([`Watched::reload_if_changed`]),
    /// logging each change loaded or refused; `what` names the files in the logs.
    pub async fn watch(self, what: &'static str, period: Duration, shutdown: CancellationToken) {
        super::every(period, shutdown, || match self.reload_if_changed() {
            None => {}
            Some(Ok(())) => tracing::info!("{what} changed on disk: loaded"),
            Some(Err(why)) => {
                tracing::warn!(error = %why, "{what} changed on disk and cannot be loaded; the ones in use stay")
            }
        })
        .await;
    }
}

impl<T: FromFiles> std::fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched").field("files", &self.files()).finish_non_exhaustive()
    }
}
