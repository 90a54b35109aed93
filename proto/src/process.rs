//! Process plumbing shared by kvroute's binaries: logging setup and signal handling.

use tokio_util::sync::CancellationToken;

/// Logs to stderr through `tracing`, filtered by `RUST_LOG` (default `info`); set
/// `KVROUTE_LOG_FORMAT=json` for one JSON object per line.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let result = if std::env::var("KVROUTE_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if let Err(e) = result {
        eprintln!("logging was already set up: {e}");
    }
}

/// Whether `problem` names the flag `--key` (not one it begins, as `--key-file`).
fn names_flag(problem: &str, key: &str) -> bool {
    let flag = format!("--{key}");
    problem.match_indices(&flag).any(|(at, _)| {
        let next = problem[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[cfg(test)]
#[test]
fn a_problem_names_a_flag_whole() {
    assert!(names_flag("--admin-token is required", "admin-token"));
    assert!(names_flag("needs --admin-token", "admin-token"));
    assert!(!names_flag("--admin-token-file is unreadable", "admin-token"));
    assert!(!names_flag("--max-queued must be at most 5", "max-queue"));
}

/// Prints what `validate` found wrong, one problem a line.
fn report_invalid(lead: &str, errors: Vec<String>) {
    eprintln!("{lead} invalid configuration:");
    for e in errors {
        eprintln!("  - {e}");
    }
}

/// Cancels `token` on the first SIGTERM or SIGINT (Ctrl-C), so every task drains; a second
/// one exits at once (a drain a peer holds up is not waited for twice).
pub async fn cancel_on_signal(token: CancellationToken) {
    next_signal().await;
    tracing::info!("shutdown requested");
    token.cancel();
    next_signal().await;
    tracing::warn!("second signal: exiting without waiting for the drain");
    std::process::exit(130);
}

/// The next SIGTERM or SIGINT (Ctrl-C).
pub async fn next_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the process");
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The whole `main` of a kvroute server binary: parse flags, environment and `--config`
/// (bad input exits non-zero with clap's message or every configuration problem at once:
/// a file's bad keys, and what `validate` finds in the rest),
/// set up logging, then run until SIGTERM/SIGINT and map the outcome to an exit code.
pub async fn main<C, V, R, F, E>(name: &str, validate: V, run: R) -> std::process::ExitCode
where
    C: crate::cli::Layered,
    V: FnOnce(&C) -> Result<(), Vec<String>>,
    R: FnOnce(C, CancellationToken) -> F,
    F: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let config: C = match crate::cli::parse() {
        Ok(config) => config,
        Err(crate::cli::Refused { error: crate::cli::ConfigError::Cli(e), .. }) => e.exit(),
        Err(refused) => {
            eprintln!("{name}: {}", refused.error);
            if let Some(Err(mut errors)) = refused.rest.as_ref().map(validate) {
                // A check of a refused key's setting saw its default, not what the file meant.
                errors.retain(|e| !refused.keys.iter().any(|key| names_flag(e, key)));
                if !errors.is_empty() {
                    report_invalid(&format!("{name}: and, without those keys,"), errors);
                }
            }
            return std::process::ExitCode::from(2);
        }
    };
    if let Err(errors) = validate(&config) {
        report_invalid(&format!("{name}:"), errors);
        return std::process::ExitCode::from(2);
    }
    init_tracing();
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    match run(config, shutdown).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
