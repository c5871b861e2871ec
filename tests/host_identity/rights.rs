//! The rights findings of issue 45 (see the binary's docs).
