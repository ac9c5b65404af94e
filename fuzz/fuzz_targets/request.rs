#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice::fuzzing::request::request(data));
