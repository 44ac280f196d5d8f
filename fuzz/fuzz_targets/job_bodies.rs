#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_api::fuzz_bodies::job_bodies(data));
