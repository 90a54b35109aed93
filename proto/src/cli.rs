//! Layered configuration for kvroute's binaries: command-line flags win over environment
//! variables (both handled by clap), which win over a TOML file given with `--config`, which
//! wins over the built-in defaults.
//!
//! A binary's config is one struct that derives `clap::Parser` (every field a flag, most with
//! `env = "KVROUTE_..."`) and serde's `Serialize`/`Deserialize` with
//! `rename_all = "kebab-case"`, so a file key is spelled exactly like its flag without the
//! dashes in front. The merge goes through TOML: the parsed flags are serialized, every file
//! key whose flag was not given on the command line or in the environment replaces the
//! default, and the result is deserialized back. Unknown file keys and file values of the
//! wrong type are all reported at once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::ArgAction;
use clap::parser::ValueSource;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A config struct that can name its own `--config` file.
pub trait Layered: clap::Parser + Serialize + DeserializeOwned {
    /// The TOML file given with `--config`, if any.
    fn config_file(&self) -> Option<&Path>;
}

/// Why the configuration could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Bad flags, `--help` or `--version`: call `.exit()` to print it the way clap does.
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    File { path: PathBuf, message: String },
}

/// A configuration refused, with what could still be read of it.
#[derive(Debug)]
pub struct Refused<C> {
    pub error: ConfigError,
    /// The flags and every key of the file that is fine alone, when the file is what was
    /// wrong: a binary checks it too, so that one run reports every problem, not the file's
    /// alone (after it is fixed, its semantic checks could still fail on another setting).
    pub rest: Option<C>,
    /// The file's keys that were refused (unknown, or with a bad value): the rest's checks
    /// about them are beside the point (they were read at their defaults).
    pub keys: Vec<String>,
}

impl<C> From<ConfigError> for Refused<C> {
    fn from(error: ConfigError) -> Self {
        Refused { error, rest: None, keys: Vec::new() }
    }
}

impl<C> From<clap::Error> for Refused<C> {
    fn from(error: clap::Error) -> Self {
        ConfigError::from(error).into()
    }
}

/// Parses the process's arguments and environment, then the `--config` file.
pub fn parse<C: Layered>() -> Result<C, Refused<C>> {
    parse_keeping_rest::<C, _, _>(std::env::args_os())
}

/// [`parse`] with explicit arguments (the first is the program name).
pub fn parse_from<C, I, T>(args: I) -> Result<C, ConfigError>
where
    C: Layered,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    parse_keeping_rest(args).map_err(|refused| refused.error)
}

/// `C` with every setting at its default: no flags, and no environment read (a config built
/// by a program, such as an embedded fleet's, is not the operator's shell's: a
/// `KVROUTE_API_KEY` exported for the real router would lock the load generator's routers).
pub fn defaults<C: clap::Parser>() -> C {
    let command = C::command().no_binary_name(true).mut_args(|arg| arg.env(None::<&'static str>));
    let matches = command.get_matches_from(std::iter::empty::<OsString>());
    C::from_arg_matches(&matches)
        .unwrap_or_else(|e| panic!("the defaults of {}: {e}", C::command().get_name()))
}

/// [`parse_from`], keeping what could be read of a config refused for its file's keys.
pub fn parse_keeping_rest<C, I, T>(args: I) -> Result<C, Refused<C>>
where
    C: Layered,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut command = C::command();
    let matches = command.try_get_matches_from_mut(args)?;
    let cli = C::from_arg_matches(&matches)?;
    let Some(path) = cli.config_file().map(Path::to_path_buf) else {
        return Ok(cli);
    };
    let text =
        std::fs::read_to_string(&path).map_err(|source| ConfigError::Read { path: path.clone(), source })?;
    let file_error = |message: String| ConfigError::File { path: path.clone(), message };
    let file: toml::Table = text.parse().map_err(|e: toml::de::Error| file_error(syntax_error(&text, &e)))?;
    // The flags are merged as TOML, which cannot hold every value a flag can: a number above
    // TOML's signed 64-bit integers, or a null inside a JSON object.
    let mut merged = toml::Table::try_from(&cli).map_err(|e| {
        let e = e.to_string();
        let why = match e.contains("too large") {
            true => format!("with a config file, numbers are at most {}", i64::MAX),
            false => "with a config file, flags must hold what TOML can (JSON without nulls)".to_owned(),
        };
        file_error(format!("the flags and environment cannot be merged with it ({e}): {why}"))
    })?;
    // The flags alone read back (else every file key would be blamed for them).
    let flags = merged.clone();
    C::deserialize(flags.clone()).map_err(|e| file_error(format!("the flags and environment: {e}")))?;
    let (mut unknown, mut bad, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for (key, value) in file {
        // A key is its flag's long name exactly: serde reads no other spelling, so a
        // `block_size` accepted here would be dropped without a word. `config`, `help` and
        // `version` are flags but no settings.
        let setting = |a: &clap::Arg| {
            !matches!(
                a.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
        };
        let flag = |name: &str| {
            command.get_arguments().find(|a| a.get_long() == Some(name) && name != "config" && setting(a))
        };
        let Some(arg) = flag(&key) else {
            refused.push(key.clone());
            let kebab = key.replace('_', "-");
            unknown.push(match flag(&kebab) {
                Some(_) => format!("{key} (spelled {kebab})"),
                None => key,
            });
            continue;
        };
        let from_user = matches!(
            matches.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        // Each value is checked on its own, so that every bad one is reported at once (one a
        // flag overrides too: the file is wrong wherever the flag is not given).
        let mut alone = flags.clone();
        alone.insert(key.clone(), value.clone());
        match C::deserialize(alone) {
            Ok(_) if !from_user => {
                merged.insert(key, value);
            }
            Ok(_) => {}
            Err(_) if is_secret(&key) => {
                bad.push(format!("{key}: not a value it takes (a secret's value is not shown)"));
                refused.push(key);
            }
            Err(e) => {
                bad.push(format!("{key}: {}", e.message().trim_end()));
                refused.push(key);
            }
        }
    }
    let mut problems = Vec::new();
    if !unknown.is_empty() {
        problems.push(format!("unknown keys: {}", unknown.join(", ")));
    }
    problems.extend(bad);
    if !problems.is_empty() {
        let rest = C::deserialize(merged).ok();
        return Err(Refused { error: file_error(problems.join("; ")), rest, keys: refused });
    }
    Ok(C::deserialize(merged).map_err(|e| file_error(e.to_string()))?)
}

/// Whether the file key `key` holds a secret (`admin-token`, `api-key`): an error about its
/// value does not quote it.
fn is_secret(key: &str) -> bool {
    ["token", "key", "secret", "password"].iter().any(|word| key.contains(word))
}

/// `e`, a syntax error in the config file `text`, by its line and column and without the
/// line itself (toml's own text quotes it, and it may hold a secret: a token left unquoted).
fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim_end();
    let Some(before) = e.span().and_then(|span| text.get(..span.start)) else { return message.to_owned() };
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |start| start.chars().count()) + 1;
    format!("line {line}, column {column}: {message}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(clap::Parser, Serialize, Deserialize, Debug, PartialEq)]
    #[serde(rename_all = "kebab-case")]
    struct Demo {
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        config: Option<PathBuf>,
        #[arg(long, default_value_t = 16)]
        block_size: u32,
        #[arg(long, env = "KVROUTE_TEST_CLI_MODEL", default_value = "m")]
        model: String,
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        salt: Option<String>,
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        admin_token: Option<String>,
    }

    impl Layered for Demo {
        fn config_file(&self) -> Option<&Path> {
            self.config.as_deref()
        }
    }

    fn file(text: &str) -> tempfile_path::TempPath {
        tempfile_path::write(text)
    }

    /// A throwaway file under the target directory, removed on drop.
    mod tempfile_path {
        use std::path::PathBuf;
        use std::sync::atomic::{AtomicU32, Ordering};

        pub struct TempPath(pub PathBuf);
        impl Drop for TempPath {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        pub fn write(text: &str) -> TempPath {
            static N: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "kvroute-cli-{}-{}.toml",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, text).unwrap();
            TempPath(path)
        }
    }

    /// A config's defaults read no environment, where a parse of the command line does. (Run
    /// again in a child process with the variable set: the environment is the process's.)
    #[test]
    fn defaults_read_no_environment() {
        if std::env::var_os("KVROUTE_TEST_CLI_MODEL").is_some() {
            assert_eq!(parse_from::<Demo, _, _>(["x"]).unwrap().model, "from-env", "the variable is read");
            assert_eq!(defaults::<Demo>().model, "m");
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "cli::tests::defaults_read_no_environment", "--quiet"])
            .env("KVROUTE_TEST_CLI_MODEL", "from-env")
            .output()
            .unwrap();
        assert!(child.status.success(), "{}", String::from_utf8_lossy(&child.stdout));
    }

    /// A config file's errors never quote a secret's value: neither a syntax error (a token
    /// pasted unquoted, whose line toml's own message quotes) nor a value of the wrong type.
    #[test]
    fn file_errors_do_not_show_secrets() {
        for (text, expected) in [
            ("block-size = 8\nadmin-token = 3f9ahunter2\n", "line 2, column"),
            ("admin-token = 31415926\n", "admin-token: not a value it takes"),
        ] {
            let f = file(text);
            let e =
                parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err().to_string();
            assert!(e.contains(expected) && !e.contains("hunter2") && !e.contains("31415926"), "{e}");
        }
        // Other values are quoted, to point at the mistake.
        let f = file("seed = \"many\"\n");
        let e = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err().to_string();
        assert!(e.contains("many"), "{e}");
    }

    #[test]
    fn file_fills_what_flags_did_not_set() {
        let f = file("block-size = 64\nmodel = \"from-file\"\nsalt = \"s\"\n");
        let c: Demo = parse_from(["x", "--config", f.0.to_str().unwrap(), "--model", "from-flag"]).unwrap();
        assert_eq!(c.block_size, 64);
        assert_eq!(c.model, "from-flag");
        assert_eq!(c.salt.as_deref(), Some("s"));
    }

    #[test]
    fn without_file_defaults_apply() {
        let c: Demo = parse_from(["x"]).unwrap();
        assert_eq!((c.block_size, c.model.as_str(), c.salt), (16, "m", None));
    }

    #[test]
    fn unknown_keys_are_all_reported() {
        let f = file("bogus = 1\nalso-bogus = 2\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err();
        let ConfigError::File { message, .. } = err else { panic!("file error expected, got {err:?}") };
        assert!(message.contains("bogus") && message.contains("also-bogus"), "{message}");
    }

    /// Unknown keys and every value of the wrong type are reported together.
    #[test]
    fn every_bad_key_of_a_file_is_reported_at_once() {
        let f = file("bogus = 1\nblock-size = \"big\"\nseed = -1\nmodel = \"fine\"\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err();
        let ConfigError::File { message, .. } = err else { panic!("file error expected, got {err:?}") };
        for key in ["bogus", "block-size", "seed"] {
            assert!(message.contains(key), "{key} not reported: {message}");
        }
        assert!(!message.contains("model"), "{message}");
        // A bad value is reported even where a flag overrides it.
        let f = file("block-size = \"big\"\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap(), "--block-size", "8"]);
        assert!(matches!(err, Err(ConfigError::File { ref message, .. }) if message.contains("block-size")));
    }

    /// A file refused for some keys keeps the flags and its other keys, for the binary's
    /// checks; a flag still wins over the file.
    #[test]
    fn a_refused_file_keeps_its_good_keys() {
        let f = file("bogus = 1\nblock-size = 64\nseed = \"x\"\nsalt = \"s\"\nmodel = \"file\"\n");
        let refused =
            parse_keeping_rest::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap(), "--model", "flag"])
                .unwrap_err();
        assert!(matches!(refused.error, ConfigError::File { .. }), "{:?}", refused.error);
        let rest = refused.rest.expect("the rest is read");
        assert_eq!((rest.block_size, rest.salt.as_deref(), rest.seed), (64, Some("s"), None));
        assert_eq!(rest.model, "flag");
        // Flags clap refuses leave nothing to check.
        let refused = parse_keeping_rest::<Demo, _, _>(["x", "--block-size", "-3"]).unwrap_err();
        assert!(matches!(refused.error, ConfigError::Cli(_)) && refused.rest.is_none());
    }

    #[test]
    fn keys_spelled_with_underscores_are_unknown() {
        let f = file("block_size = 64\nmodel = \"from-file\"\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err();
        let ConfigError::File { message, .. } = err else { panic!("file error expected, got {err:?}") };
        assert!(message.contains("block_size (spelled block-size)"), "{message}");
        assert!(!message.contains("model"), "{message}");
    }

    /// A config file that cannot be read says why.
    #[test]
    fn an_unreadable_config_file_says_why() {
        let dir = std::env::temp_dir();
        let err = parse_from::<Demo, _, _>(["x", "--config", dir.to_str().unwrap()]).unwrap_err();
        let ConfigError::Read { source, .. } = &err else { panic!("a read error expected, got {err:?}") };
        assert_eq!(source.kind(), std::io::ErrorKind::IsADirectory);
        assert!(err.to_string().ends_with(&source.to_string()), "the cause is in the message: {err}");
    }

    /// A flag's number beyond TOML's integers, with a config file: an error that says so.
    #[test]
    fn numbers_beyond_tomls_are_an_error_that_says_so() {
        let f = file("block-size = 64\n");
        let path = f.0.to_str().unwrap();
        let parsed =
            parse_from::<Demo, _, _>(["x", "--config", path, "--seed", &i64::MAX.to_string()]).unwrap();
        assert_eq!(parsed.seed, Some(i64::MAX as u64));
        let err =
            parse_from::<Demo, _, _>(["x", "--config", path, "--seed", &u64::MAX.to_string()]).unwrap_err();
        let ConfigError::File { message, .. } = err else { panic!("file error expected, got {err:?}") };
        assert!(message.contains(&i64::MAX.to_string()), "{message}");
    }

    #[test]
    fn the_config_key_itself_is_unknown() {
        let f = file("config = \"other.toml\"\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err();
        assert!(
            matches!(err, ConfigError::File { ref message, .. } if message.contains("config")),
            "{err:?}"
        );
        // So are clap's own flags, which set nothing.
        let f = file("help = true\n");
        let err = parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]).unwrap_err();
        assert!(matches!(err, ConfigError::File { ref message, .. } if message.contains("help")), "{err:?}");
    }

    #[test]
    fn wrong_types_and_bad_flags_are_errors() {
        let f = file("block-size = \"big\"\n");
        assert!(matches!(
            parse_from::<Demo, _, _>(["x", "--config", f.0.to_str().unwrap()]),
            Err(ConfigError::File { .. })
        ));
        assert!(matches!(parse_from::<Demo, _, _>(["x", "--block-size", "-3"]), Err(ConfigError::Cli(_))));
        assert!(matches!(
            parse_from::<Demo, _, _>(["x", "--config", "/nonexistent/k.toml"]),
            Err(ConfigError::Read { .. })
        ));
    }
}
