#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate::fuzz_bodies::jsonl_lines(data));
