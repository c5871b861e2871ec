//! The frame decoder: arbitrary byte streams, split arbitrarily, must decode the same way
//! every time and never panic. Logic: `baton_messages::fuzzing::frame_decoder`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    baton_messages::fuzzing::frame_decoder(data);
});
