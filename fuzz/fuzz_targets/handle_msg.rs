//! Handle-message validation: decoding, sealing, checking, and the import cache's refusal
//! to hand an unchecked, stale or oversized handle to a backend. Logic:
//! `baton_ipc::fuzzing::handle_msg`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    baton_ipc::fuzzing::handle_msg(data);
});
