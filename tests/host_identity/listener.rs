//! The listener findings of issue 45 (see the binary's docs).
