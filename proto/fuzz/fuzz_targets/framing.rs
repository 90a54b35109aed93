//! `cargo fuzz run framing`: see `kvroute_proto_fuzz::framing`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_proto_fuzz::framing(data));
