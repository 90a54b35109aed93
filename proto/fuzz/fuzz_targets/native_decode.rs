//! `cargo fuzz run native_decode`: see `kvroute_proto_fuzz::native_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_proto_fuzz::native_decode(data));
