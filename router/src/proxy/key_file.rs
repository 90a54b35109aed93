//! API keys from a file (`--api-key-file`), for keys that rotate without a restart: a
//! Kubernetes Secret mounted as a volume, which the kubelet updates in place, where one passed
//! in the environment is fixed for the process's life.
//!
//! - The file holds keys separated by commas, blanks or lines; a word that begins with `#`
//!   begins a comment, to the end of its line (a `#` within a key is the key's).
//! - It is read at the start (a file that cannot be read, or holds no key, stops the start
//!   with the other configuration errors), at each `SIGHUP`, and whenever what it holds
//!   changes ([`KeyFile::watch`]). Its keys pass as `--api-key`'s do; requests admitted from
//!   then on are checked against the new ones, and open WebSocket tunnels whose key is gone end
//!   ([`super::tunnel`]).
//! - A file that can no longer be read, or holds no key (emptied, or caught as its first key
//!   is written), keeps the keys in use: an emptied file never opens the API. The error is
//!   logged: once for the same contents, at each check while it cannot be read. Write the
//!   file whole, by a rename into place (as the kubelet does with a Secret's volume): one
//!   caught half-written with a key or more in it is loaded as it is, until the next check.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvroute_proto::serve::read_file;
use tokio_util::sync::CancellationToken;

use super::live::{Admission, Live};

/// The key file in use, if any. Every change to the admission's keys goes through it, so
/// that a reload and a change on disk at once lose neither.
#[derive(Debug, Default)]
pub struct KeyFile {
    loaded: Mutex<Option<Loaded>>,
    /// Loads of a file since the start (at a reload, or of a change on disk): done, and
    /// refused.
    loads: [AtomicU64; 2],
}

/// A key file as last read.
struct Loaded {
    path: PathBuf,
    /// What it held when last read, its keys or not: a change is loaded (or refused) once.
    seen: Vec<u8>,
    /// Its keys last loaded.
    keys: Vec<String>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The keys are secrets: how many there are, only.
        f.debug_struct("Loaded").field("path", &self.path).field("keys", &self.keys.len()).finish()
    }
}

impl KeyFile {
    /// The keys in the file at `path` (none without one), or what is wrong with it.
    pub fn open(path: Option<&Path>) -> Result<Self, String> {
        let loaded = path.map(read).transpose()?;
        Ok(Self { loaded: Mutex::new(loaded), loads: Default::default() })
    }

    /// Loads of a file since the start, at a reload or of a change on disk: how many were
    /// done, and how many refused (the keys in use stayed); `None` while no file is named.
    pub fn loads(&self) -> Option<(u64, u64)> {
        self.lock().as_ref()?;
        let [done, refused] = &self.loads;
        Some((done.load(Ordering::Relaxed), refused.load(Ordering::Relaxed)))
    }

    /// Whether a file's keys are loaded.
    pub fn is_loaded(&self) -> bool {
        self.lock().is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Loaded>> {
        self.loaded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count<T>(&self, made: &Result<T, String>) {
        self.loads[usize::from(made.is_err())].fetch_add(1, Ordering::Relaxed);
    }

    /// `admission` with this file's keys.
    pub fn with_keys(&self, admission: &Admission) -> Admission {
        admission.with_file_keys(keys(&self.lock()))
    }

    /// Reads the file at `path` now (`None`: no file) and watches it from then on, and puts in
    /// `live` `admission` (a reload's new one; `None`: the one in force) with its keys, in
    /// place of the last file's: one change, so that no request or tunnel sees the new
    /// admission with the old file's keys. How many keys the file holds, or what is wrong with
    /// it (then the file and its keys in use stay, with `admission` all the same).
    pub fn load(
        &self,
        path: Option<&Path>,
        admission: Option<Admission>,
        live: &Live<Admission>,
    ) -> Result<usize, String> {
        let mut loaded = self.lock();
        let read = path.map(read).transpose().map(|now| *loaded = now);
        if path.is_some() {
            self.count(&read);
        }
        // A file that cannot be read where none was loaded before: the admission in force stays
        // whole (the new one, without the file's keys, could let every request pass).
        if read.is_err() && loaded.is_none() {
            return read.map(|()| 0);
        }
        match admission {
            Some(admission) => live.set(admission.with_file_keys(keys(&loaded))),
            None => live.update(|admission| admission.with_file_keys(keys(&loaded))),
        }
        read.map(|()| keys(&loaded).len())
    }

    /// Loads the file again if what it holds changed since it was last read: `None` if it did
    /// not (or there is no file), else how many keys it holds now, or why they cannot be
    /// loaded (then the ones in use stay, and the same contents are not tried again).
    pub fn reload_if_changed(&self, live: &Live<Admission>) -> Option<Result<usize, String>> {
        let mut guard = self.lock();
        let loaded = guard.as_mut()?;
        let now = read_file(&loaded.path);
        let parsed = match now {
            Ok(now) if now == loaded.seen => return None,
            Ok(now) => {
                let parsed = parse(&loaded.path, &now);
                loaded.seen = now;
                parsed
            }
            Err(why) => Err(why),
        };
        self.count(&parsed);
        Some(parsed.map(|keys| {
            live.update(|admission| admission.with_file_keys(&keys));
            loaded.keys = keys;
            loaded.keys.len()
        }))
    }

    /// Checks the file every `period` until `shutdown` fires ([`KeyFile::reload_if_changed`]),
    /// logging each change loaded or refused.
    pub async fn watch(
        self: std::sync::Arc<Self>,
        live: Live<Admission>,
        period: Duration,
        shutdown: CancellationToken,
    ) {
        kvroute_proto::serve::every(period, shutdown, || match self.reload_if_changed(&live) {
            None => {}
            Some(Ok(keys)) => tracing::info!(keys, "--api-key-file changed: its keys loaded"),
            Some(Err(why)) => {
                tracing::warn!(error = %why, "--api-key-file changed and cannot be loaded; the keys in use stay")
            }
        })
        .await;
    }
}

/// The keys of `loaded`, none without a file.
fn keys(loaded: &Option<Loaded>) -> &[String] {
    loaded.as_ref().map_or(&[], |loaded| &loaded.keys)
}

/// The key file at `path`, read.
fn read(path: &Path) -> Result<Loaded, String> {
    let seen = read_file(path)?;
    let keys = parse(path, &seen)?;
    Ok(Loaded { path: path.to_owned(), seen, keys })
}

/// The keys in `contents`, the file at `path`'s.
pub(super) fn parse(path: &Path, contents: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(contents).map_err(|_| format!("{}: not UTF-8 text", path.display()))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // A word that begins with `#` begins a comment: a `#` within a key is the key's.
    let keys: Vec<String> = (text.lines())
        .flat_map(|line| {
            let words = line.split(|c: char| c == ',' || c.is_whitespace()).filter(|word| !word.is_empty());
            words.take_while(|word| !word.starts_with('#'))
        })
        .map(str::to_owned)
        .collect();
    match keys.is_empty() {
        true => {
            Err(format!("{}: holds no key (keys are separated by commas, blanks or lines)", path.display()))
        }
        false => Ok(keys),
    }
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::config::Config;

    fn allows(live: &Live<Admission>, key: &str) -> bool {
        let bearer = format!("Bearer {key}");
        live.get().allows(&Method::POST, "/v1/completions", Some(bearer.as_bytes()))
    }

    /// Keys by commas, blanks and lines, comments left out; a file without any is refused.
    #[test]
    fn keys_are_split_by_commas_blanks_and_lines() {
        let path = Path::new("keys");
        let keys = "\u{feff}# team a\nsk-a, sk-b\n\n  sk-c\tsk-d\r\n  # sk-gone\nsk-e  # team e\nsk-#f,#g\n";
        assert_eq!(parse(path, keys.as_bytes()).unwrap(), ["sk-a", "sk-b", "sk-c", "sk-d", "sk-e", "sk-#f"]);
        for empty in [&b""[..], b"\n", b" , \n", b"# only a comment\n"] {
            let refused = parse(path, empty).unwrap_err();
            assert!(refused.starts_with("keys: holds no key"), "{refused}");
        }
        assert!(parse(path, b"sk-\xff").unwrap_err().contains("UTF-8"));
    }

    /// A change on disk replaces the file's keys, `--api-key`'s stay; an emptied or vanished
    /// file keeps the keys in use; the same contents are loaded once.
    #[test]
    fn a_change_on_disk_replaces_the_files_keys_and_an_emptied_file_keeps_them() {
        let dir = std::env::temp_dir().join(format!("kvroute-key-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys");
        std::fs::write(&path, "sk-old\n").unwrap();
        let config = Config { api_key: vec!["sk-flag".into()], ..Config::loopback(Vec::new()) };
        let file = KeyFile::open(Some(&path)).unwrap();
        let live = Live::new(file.with_keys(&Admission::new(&config)));
        assert!(allows(&live, "sk-old") && allows(&live, "sk-flag") && !allows(&live, "sk-new"));
        assert_eq!(file.reload_if_changed(&live), None, "unchanged");

        std::fs::write(&path, "sk-new,sk-newer").unwrap();
        assert_eq!(file.reload_if_changed(&live), Some(Ok(2)));
        assert!(allows(&live, "sk-new") && allows(&live, "sk-newer") && allows(&live, "sk-flag"));
        assert!(!allows(&live, "sk-old"), "rotated out");

        std::fs::write(&path, "").unwrap();
        assert!(file.reload_if_changed(&live).unwrap().is_err());
        assert_eq!(file.reload_if_changed(&live), None, "refused once");
        assert!(allows(&live, "sk-new") && !allows(&live, "anything"), "an emptied file opens nothing");
        std::fs::remove_file(&path).unwrap();
        assert!(file.reload_if_changed(&live).unwrap().is_err());
        assert!(allows(&live, "sk-new") && !allows(&live, "anything"));

        // A reload's new admission keeps the file's keys where the file cannot be read; a
        // reload without the file drops them.
        let unflagged = Admission::new(&Config { api_key: Vec::new(), ..config.clone() });
        assert_eq!(file.load(Some(&path), Some(unflagged), &live).map_err(|e| e.contains("keys")), Err(true));
        assert!(allows(&live, "sk-new") && !allows(&live, "sk-flag"), "the new admission, the file's keys");
        assert!(!allows(&live, "anything"), "a file that cannot be read keeps them");
        assert_eq!(file.load(None, None, &live), Ok(0));
        assert!(allows(&live, "anything"), "no keys left: the API is open, as the configuration says");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A reload from `--api-key` to a key file that cannot be read, none loaded before, keeps
    /// the admission in force: the new one, without keys, would let every request pass.
    #[test]
    fn a_first_key_file_that_cannot_be_read_keeps_the_admission_in_force() {
        let config = Config { api_key: vec!["sk-flag".into()], ..Config::loopback(Vec::new()) };
        let file = KeyFile::open(None).unwrap();
        let live = Live::new(file.with_keys(&Admission::new(&config)));
        let unflagged = Admission::new(&Config { api_key: Vec::new(), ..config });
        let missing = std::env::temp_dir().join(format!("kvroute-no-keys-{}", std::process::id()));
        assert!(file.load(Some(&missing), Some(unflagged), &live).is_err());
        assert!(allows(&live, "sk-flag") && !allows(&live, "anything"), "still guarded");
    }
}
