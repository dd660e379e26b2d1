#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gpuhealth_fuzz::kernel_log(data));
