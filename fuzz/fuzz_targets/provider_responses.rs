#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_workers::fuzz_bodies::provider_responses(data));
