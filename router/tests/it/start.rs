//! Starting a router that cannot start.

use kvroute_router::Config;
use tokio_util::sync::CancellationToken;

use crate::support::{nowhere, wait_until};

/// A router whose admin port is taken fails to start once its replica's event stream is
/// being followed: every task it had started ends (before, the ingest's went on following
/// the stream for good), and the caller's token is left as it was (a child token that the
/// start cancelled would be the same token to a caller that passed it).
#[tokio::test]
async fn a_start_that_fails_stops_what_it_started() {
    let runtime = tokio::runtime::Handle::current().metrics();
    let before = runtime.num_alive_tasks();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let replica = format!("name=r,http=http://127.0.0.1:1,events={},engine=kvroute", nowhere());
    let config = Config {
        admin_listen: taken.local_addr().unwrap(),
        drain_timeout_ms: 0,
        ..Config::loopback(vec![replica.parse().unwrap()])
    };
    let shutdown = CancellationToken::new();
    let failed =
        kvroute_router::start(config, shutdown.clone()).await.map(drop).expect_err("the port is taken");
    assert!(format!("{failed:#}").contains("binding"), "{failed:#}");
    assert!(!shutdown.is_cancelled(), "the caller's token is the caller's");
    wait_until("every task the start began ends", || runtime.num_alive_tasks() <= before).await;
}

/// A router stopped ends every task it began, however long its drain timeout: the timer that
/// cuts streams still open at the drain's end goes with the router's last task (it slept out
/// the timeout after the router had stopped).
#[tokio::test]
async fn a_stopped_router_leaves_no_task_behind() {
    let runtime = tokio::runtime::Handle::current().metrics();
    let before = runtime.num_alive_tasks();
    let replica = format!("name=r,http=http://127.0.0.1:1,events={},engine=kvroute", nowhere());
    let config = Config { drain_timeout_ms: 3_600_000, ..Config::loopback(vec![replica.parse().unwrap()]) };
    let router = kvroute_router::start(config, CancellationToken::new()).await.unwrap();
    router.stop().await;
    wait_until("every task the router began ends", || runtime.num_alive_tasks() <= before).await;
}
