//! Starting an agent that cannot start.

use std::time::Duration;

use kvroute_replica_agent::config::Config;
use tokio_util::sync::CancellationToken;

/// An agent whose gRPC port is taken fails to start once its engine and event publisher run:
/// every task it had started ends (the schedulers and publishers, which hold the event and
/// replay ports), and the caller's token is left as it was.
#[tokio::test]
async fn a_start_that_fails_stops_what_it_started() {
    let runtime = tokio::runtime::Handle::current().metrics();
    let before = runtime.num_alive_tasks();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = Config { grpc_addr: taken.local_addr().unwrap(), ..Config::loopback("a") };
    let shutdown = CancellationToken::new();
    let failed = kvroute_replica_agent::start(config, shutdown.clone())
        .await
        .map(drop)
        .expect_err("the port is taken");
    assert!(format!("{failed:#}").contains("binding gRPC"), "{failed:#}");
    assert!(!shutdown.is_cancelled(), "the caller's token is the caller's");
    let ended = async {
        while runtime.num_alive_tasks() > before {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended).await.expect("every task the start began ends");
}
