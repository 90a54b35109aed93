//! kvroute's load generator: workload replay, fleet measurement, reports, the offline
//! simulator and the local demo.
#![forbid(unsafe_code)]
