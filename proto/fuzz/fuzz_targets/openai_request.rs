//! `cargo fuzz run openai_request`: see `kvroute_proto_fuzz::openai_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_proto_fuzz::openai_request(data));
