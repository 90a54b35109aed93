//! `cargo fuzz run vllm_decode`: see `kvroute_proto_fuzz::vllm_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_proto_fuzz::vllm_decode(data));
