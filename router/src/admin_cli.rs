//! `kvroute-admin`: the router's admin service ([`crate::admin`]) from a shell, for what an
//! operator does by hand: list the replicas and their stream state, drain one before its
//! maintenance (and resume it after), add one or remove one, ask where a request would go and
//! why. It prints tables, or with `--output json` the router's answers as JSON, for scripts.
//!
//! It reaches the admin service at `--url` (plain `http://`, or `https://` when the router
//! serves it with `--admin-tls`: the server's certificate checked against `--ca-cert`, or the
//! system's authorities, by the URL's host name or `--server-name`; `--client-cert` and
//! `--client-key` for mutual TLS), sending `--token` (`KVROUTE_ADMIN_TOKEN`, as the router
//! reads it) as a bearer token. A refusal, or a router that cannot be reached (within
//! [`CONNECT_TIMEOUT`]; a call within [`CALL_TIMEOUT`]), is an error message and a non-zero
//! exit. A drain of a replica out of the fleet that the router keeps for the name's return
//! (or lifts) says so, and succeeds.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;

use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Parser, Subcommand};
use futures::TryFutureExt;
use hyper_util::rt::TokioIo;
use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use tokio_rustls::rustls::pki_types::ServerName;
use tonic::transport::{Channel, Endpoint};

use crate::admin::spec_message;
use crate::config::ReplicaConfig;

/// How long connecting to the admin service may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one call may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The command line of `kvroute-admin`.
#[derive(Parser, Debug)]
#[command(name = "kvroute-admin", version, about = "The kvroute router's admin service, from a shell")]
pub struct Cli {
    /// The admin service: `http://host:port`, or `https://host:port` for one served with
    /// `--admin-tls`.
    #[arg(long, env = "KVROUTE_ADMIN_URL", default_value = "http://127.0.0.1:50061")]
    pub url: String,
    /// The router's `--admin-token`.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM certificates of the authorities the service's certificate must chain to (https);
    /// the system's without it.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// The name the service's certificate must hold, where the URL names it otherwise (a pod's
    /// address, say).
    #[arg(long)]
    pub server_name: Option<String>,
    /// PEM certificate chain to show a service that asks for one (`--tls-client-ca`), with
    /// `--client-key`.
    #[arg(long, requires = "client_key")]
    pub client_cert: Option<PathBuf>,
    /// The private key of `--client-cert`.
    #[arg(long, requires = "client_cert")]
    pub client_key: Option<PathBuf>,
    /// How to print the router's answers: tables, or JSON (enums by name, `exact`, `vllm`).
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

/// How `kvroute-admin` prints what the router answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

/// What to ask of the router.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Every replica: stream state, health, drain, load and blocks indexed.
    List,
    /// Stops sending new requests to a replica; those in flight finish.
    Drain { replica: String },
    /// Sends requests to a drained replica again.
    Resume { replica: String },
    /// Adds a replica to the fleet, as the router's `--replica` names one:
    /// `name=..,http=..[,events=..][,replay=..][,grpc=..][,engine=..][,dp-size=..][,topic=..]`
    /// `[,role=..][,bootstrap-port=..]`.
    Add { spec: ReplicaConfig },
    /// Takes a replica out of the fleet and frees what the index held for it.
    Remove { replica: String },
    /// Where a request would go and why, changing nothing: every replica's overlap and cost.
    Explain {
        /// The request's path.
        #[arg(long, default_value = "/v1/completions")]
        path: String,
        /// The request body as a client would send it; `@FILE` reads it from a file, `-` from
        /// standard input.
        body: String,
    },
}

/// Runs `cli`, writing what the router answered to `out`.
pub async fn run(cli: &Cli, out: &mut impl Write) -> anyhow::Result<()> {
    // A fleet's list (up to 1024 adapters a replica) or an explanation may pass tonic's 4 MiB.
    let mut admin = RouterAdminClient::new(channel(cli).await?).max_decoding_message_size(usize::MAX);
    match &cli.command {
        Command::List => {
            let list = admin.list_replicas(request(cli, pb::ListReplicasRequest {})?).await;
            let replicas = list.map_err(refused)?.into_inner().replicas;
            show(out, cli.output, &replicas, |out| write_list(out, &replicas))?;
        }
        Command::Drain { replica } | Command::Resume { replica } => {
            let drain = matches!(cli.command, Command::Drain { .. });
            let asked = pb::DrainRequest { id: replica.clone(), drain };
            match admin.drain(request(cli, asked)?).await {
                Ok(status) => show_status(out, cli.output, status.get_ref())?,
                Err(status)
                    if status.code() == tonic::Code::NotFound
                        && [crate::admin::DRAIN_KEPT, crate::admin::DRAIN_LIFTED]
                            .iter()
                            .any(|said| status.message().contains(said)) =>
                {
                    let said = serde_json::json!({ "message": status.message() });
                    show(out, cli.output, &said, |out| writeln!(out, "{}", status.message()))?
                }
                Err(status) => return Err(refused(status)),
            }
        }
        Command::Add { spec } => {
            let asked = pb::AddReplicaRequest { spec: Some(spec_message(&spec.to_spec("", 0))) };
            let added = admin.add_replica(request(cli, asked)?).await.map_err(refused)?.into_inner();
            show_status(out, cli.output, &added)?;
        }
        Command::Remove { replica } => {
            let asked = pb::RemoveReplicaRequest { id: replica.clone() };
            let removed = admin.remove_replica(request(cli, asked)?).await.map_err(refused)?.into_inner();
            if !removed.removed && removed.drain_lifted {
                let said = format!("no replica named {replica:?} ({})", crate::admin::DRAIN_LIFTED);
                return show(out, cli.output, &serde_json::json!({ "message": said }), |out| {
                    writeln!(out, "{said}")
                });
            }
            if !removed.removed {
                bail!("no replica named {replica:?}");
            }
            show(out, cli.output, &removed, |out| {
                writeln!(out, "removed {replica}: {} blocks freed", removed.blocks_freed)
            })?;
        }
        Command::Explain { path, body } => {
            let asked = pb::ExplainRequest { path: path.clone(), body: read_body(body)? };
            let explained = admin.explain(request(cli, asked)?).await.map_err(refused)?.into_inner();
            show(out, cli.output, &explained, |out| write_explained(out, &explained))?;
        }
    }
    Ok(())
}

/// `answer` as `output` asks: `table` writes it as a table, or it is written as JSON.
fn show<W: Write>(
    out: &mut W,
    output: Output,
    answer: &impl serde::Serialize,
    table: impl FnOnce(&mut W) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    match output {
        Output::Table => table(out)?,
        Output::Json => {
            serde_json::to_writer_pretty(&mut *out, answer)?;
            writeln!(out)?;
        }
    }
    Ok(())
}

/// One replica's status (a drain's, a resume's or an addition's answer).
fn show_status(out: &mut impl Write, output: Output, status: &pb::ReplicaStatus) -> anyhow::Result<()> {
    show(out, output, status, |out| write_list(out, std::slice::from_ref(status)))
}

/// What the router answered instead: its status code and message.
fn refused(status: tonic::Status) -> anyhow::Error {
    anyhow!("the router answered {:?}: {}", status.code(), status.message())
}

/// `message` with the bearer token, if any.
fn request<T>(cli: &Cli, message: T) -> anyhow::Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CALL_TIMEOUT);
    if let Some(token) = &cli.token {
        let value =
            format!("Bearer {token}").parse().map_err(|_| anyhow!("--token is not a header value"))?;
        request.metadata_mut().insert("authorization", value);
    }
    Ok(request)
}

/// A connection to the admin service at `cli.url`.
async fn channel(cli: &Cli) -> anyhow::Result<Channel> {
    let uri: http::Uri = cli.url.parse().with_context(|| format!("--url {}", cli.url))?;
    let unreachable = || format!("the admin service at {} cannot be reached", cli.url);
    let host = match (uri.scheme_str(), uri.host()) {
        (Some("http"), Some(_)) => {
            let endpoint = Endpoint::from_shared(cli.url.clone())?.connect_timeout(CONNECT_TIMEOUT);
            return endpoint.connect().await.with_context(unreachable);
        }
        (Some("https"), Some(host)) => host,
        _ => bail!("--url {} is not http://host:port or https://host:port", cli.url),
    };
    let identity = cli.client_cert.as_deref().zip(cli.client_key.as_deref());
    let trusted =
        kvroute_proto::serve::client_config(cli.ca_cert.as_deref(), identity).map_err(anyhow::Error::msg)?;
    let mut config = tokio_rustls::rustls::ClientConfig::clone(&trusted);
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = cli.server_name.as_deref().unwrap_or(host.trim_matches(['[', ']']));
    let name = ServerName::try_from(name.to_owned()).with_context(|| format!("server name {name}"))?;
    let address = format!("{host}:{}", uri.port_u16().unwrap_or(443));
    // The connector brings TLS: the endpoint's own scheme stays plain (tonic is built without
    // its TLS features).
    let endpoint = Endpoint::from_shared(format!("http://{address}"))?.connect_timeout(CONNECT_TIMEOUT);
    let connect = tower::service_fn(move |_: http::Uri| {
        let (connector, name) = (connector.clone(), name.clone());
        tokio::net::TcpStream::connect(address.clone())
            .and_then(move |tcp| connector.connect(name, tcp))
            .map_ok(TokioIo::new)
    });
    endpoint.connect_with_connector(connect).await.with_context(unreachable)
}

/// `body` as given: itself, a file's contents (`@FILE`), or standard input's (`-`).
fn read_body(body: &str) -> anyhow::Result<Vec<u8>> {
    if body == "-" {
        let mut read = Vec::new();
        std::io::stdin().read_to_end(&mut read).context("reading the body from standard input")?;
        return Ok(read);
    }
    match body.strip_prefix('@') {
        Some(path) => std::fs::read(path).with_context(|| format!("reading the body from {path}")),
        None => Ok(body.as_bytes().to_vec()),
    }
}

fn state(state: i32) -> &'static str {
    match pb::StreamState::try_from(state) {
        Ok(pb::StreamState::Exact) => "exact",
        Ok(pb::StreamState::Degraded) => "degraded",
        Ok(pb::StreamState::Fallback) => "fallback",
        Ok(pb::StreamState::Predicted) => "predicted",
        _ => "-",
    }
}

/// One line a replica: its name, stream state, what keeps requests from it, its load and its
/// blocks.
fn write_list(out: &mut impl Write, replicas: &[pb::ReplicaStatus]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<24} {:<10} {:<18} {:>9} {:>15} {:>10}  url",
        "replica", "stream", "routing", "in-flight", "pending-prefill", "blocks"
    )?;
    for r in replicas {
        let spec = r.spec.clone().unwrap_or_default();
        let routing = match (r.healthy, r.draining, r.not_serving) {
            (_, true, _) => "draining",
            (_, _, true) => "not serving",
            (true, false, false) => "yes",
            (false, false, false) if r.health_late => "unhealthy (late)",
            (false, false, false) => "unhealthy",
        };
        writeln!(
            out,
            "{:<24} {:<10} {:<18} {:>9} {:>15} {:>10}  {}",
            spec.id,
            state(r.state),
            routing,
            r.in_flight,
            r.pending_prefill_tokens,
            r.blocks,
            spec.http_url
        )?;
    }
    Ok(())
}

/// The decision, then one line a candidate, the chosen one first.
fn write_explained(out: &mut impl Write, explained: &pb::ExplainResponse) -> std::io::Result<()> {
    writeln!(
        out,
        "chosen {} by {}: {} prompt tokens, {} blocks{}",
        if explained.chosen.is_empty() { "no replica" } else { &explained.chosen },
        explained.policy,
        explained.prompt_tokens,
        explained.request_blocks,
        match (explained.split.as_str(), explained.prefill_chosen.as_str()) {
            ("" | "whole", _) => String::new(),
            (split, "") => format!(", {split}"),
            (split, prefill) => format!(", split {split}: prefill on {prefill}"),
        }
    )?;
    write_candidates(out, &explained.chosen, &explained.candidates)?;
    if !explained.prefill_candidates.is_empty() {
        writeln!(out, "prefill:")?;
        write_candidates(out, &explained.prefill_chosen, &explained.prefill_candidates)?;
    }
    Ok(())
}

/// One line a candidate, `chosen` first.
fn write_candidates(out: &mut impl Write, chosen: &str, candidates: &[pb::Candidate]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<24} {:>8} {:>10} {:>9} {:>12}  eligible",
        "replica", "overlap", "predicted", "in-flight", "cost"
    )?;
    let mut candidates: Vec<_> = candidates.iter().collect();
    candidates.sort_by_key(|c| c.replica != chosen);
    for c in candidates {
        let eligible = if c.eligible { "yes".to_owned() } else { format!("no ({})", c.reason) };
        writeln!(
            out,
            "{:<24} {:>8} {:>10} {:>9} {:>12.3}  {eligible}",
            c.replica, c.overlap_blocks, c.predicted_cached_tokens, c.in_flight, c.cost
        )?;
    }
    Ok(())
}
