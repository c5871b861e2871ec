//! The link handshake's sans-I/O state machines, fed arbitrary (and partly repaired)
//! messages. Logic: `baton_ipc::fuzzing::handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    baton_ipc::fuzzing::handshake(data);
});
