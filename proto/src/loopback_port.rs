//! A loopback port to bind later: for a test that starts a client before its server, or a
//! parent that picks its children's ports.
//!
//! A port taken from `bind("127.0.0.1:0")` and released comes from the kernel's ephemeral
//! range, so until it is bound again the kernel may hand it to anyone: to another test's
//! `bind(0)` (which then answers the client in its place), or as the source port of a
//! client's own `connect` to it (a TCP self-connect, which holds the port so that the server
//! cannot bind). [`unused`] picks a port outside that range instead, which the kernel never
//! hands out on its own.

use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where [`unused`] looks, when the ephemeral range leaves room below it.
const LOWEST: u16 = 10_000;

/// A port on 127.0.0.1 that nothing listened on when asked and that lies outside the
/// kernel's ephemeral range (below it, else above it); calls in one process never repeat a
/// port until they have gone through every candidate. If the range is unknown (no Linux
/// `/proc`) or leaves no room, a released ephemeral port.
pub fn unused() -> io::Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let candidates = ephemeral_range().map_or_else(Vec::new, |ephemeral| outside(&ephemeral));
    if candidates.is_empty() {
        return Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port());
    }
    // Processes start apart from each other; one process's calls walk on from there.
    let start = std::process::id().wrapping_mul(7919) as usize;
    let mut last = None;
    for _ in 0..candidates.len().min(1000) {
        let step = NEXT.fetch_add(1, Ordering::Relaxed) as usize;
        let port = candidates[start.wrapping_add(step) % candidates.len()];
        match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::AddrInUse, "no unused port")))
}

/// The ports from [`LOWEST`] up that `ephemeral` leaves out.
fn outside(ephemeral: &RangeInclusive<u16>) -> Vec<u16> {
    let above = ephemeral.end().checked_add(1).into_iter().flat_map(|first| first..=u16::MAX);
    (LOWEST..*ephemeral.start()).chain(above).collect()
}

/// The kernel's ephemeral port range, where Linux tells it.
fn ephemeral_range() -> Option<RangeInclusive<u16>> {
    let read = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    parse_range(&read)
}

fn parse_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    let (low, high) = (bounds.next()?.ok()?, bounds.next()?.ok()?);
    (low <= high).then_some(low..=high)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_lie_outside_the_ephemeral_range_and_can_be_bound() {
        let ephemeral = ephemeral_range();
        let room = ephemeral.as_ref().is_some_and(|e| !outside(e).is_empty());
        let ports: Vec<u16> = (0..20).map(|_| unused().unwrap()).collect();
        for &port in &ports {
            if let Some(ephemeral) = ephemeral.as_ref().filter(|_| room) {
                assert!(!ephemeral.contains(&port), "{port} in {ephemeral:?}");
            }
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }

    #[test]
    fn the_candidates_are_the_ports_the_range_leaves_out() {
        let below_and_above = outside(&(32768..=60999));
        assert_eq!(below_and_above.len(), (32768 - 10_000) + (65535 - 60999));
        assert!(!below_and_above.iter().any(|p| (32768..=60999).contains(p)));
        assert_eq!(outside(&(1024..=65535)), Vec::<u16>::new(), "no room: 65535 is ephemeral too");
        assert_eq!(outside(&(10_000..=65534)), vec![65535]);
    }

    #[test]
    fn the_range_is_read_as_the_kernel_writes_it() {
        assert_eq!(parse_range("32768\t60999\n"), Some(32768..=60999));
        assert_eq!(parse_range("1024 65535"), Some(1024..=65535));
        assert_eq!(parse_range("60999 32768"), None);
        assert_eq!(parse_range("garbage"), None);
    }
}
