use crate::raw::BackendKind;

/// Everything that can be wrong with bytes or data received from a peer.
///
/// Every variant means "this peer sent something this build will not act on": the caller
/// logs it once and drops the connection that carried it; nothing else is affected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The stream does not start a frame with Baton's magic bytes.
    #[error("frame starts with {got:02x?}, not Baton's magic bytes: the peer does not speak Baton")]
    BadMagic {
        /// The two bytes found instead.
        got: [u8; 2],
    },
    /// The peer speaks another protocol version.
    #[error(
        "peer speaks protocol version {got}, this build speaks {supported}: run matching versions"
    )]
    UnsupportedVersion {
        /// The version the peer announced.
        got: u8,
        /// The version this build speaks.
        supported: u8,
    },
    /// A frame larger than the limit was announced or would be written.
    #[error(
        "frame of {len} bytes exceeds the limit of {max} bytes: send bulk data in shared buffers, not inline"
    )]
    FrameTooLarge {
        /// The announced length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A frame announces more file descriptors than allowed.
    #[error("frame announces {nfds} file descriptors, at most {max} are allowed")]
    TooManyFds {
        /// The announced count.
        nfds: u8,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame: {have} of {need} bytes arrived")]
    Truncated {
        /// Bytes of the frame that arrived.
        have: usize,
        /// Bytes the frame needed.
        need: usize,
    },
    /// The payload is not a valid message.
    #[error("malformed frame payload: {0}")]
    Decode(String),
    /// The payload holds bytes after the message.
    #[error("frame payload has {0} bytes after its message")]
    TrailingBytes(usize),
    /// A message could not be encoded.
    #[error("could not encode message: {0}")]
    Encode(String),
    /// A node status (the JSON body of a `Status` message) is not one, or is too large.
    #[error("not a node status: {0}")]
    Status(String),
    /// The handle's byte range does not fit its allocation.
    #[error(
        "handle names bytes {offset}..+{len} of a {alloc_size}-byte allocation: out of bounds or empty"
    )]
    HandleOutOfBounds {
        /// Start of the buffer in the allocation.
        offset: u64,
        /// Length of the buffer.
        len: u64,
        /// Size of the allocation.
        alloc_size: u64,
    },
    /// The handle's typed layout does not cover exactly its byte length.
    #[error("handle layout needs {layout_bytes:?} bytes but the buffer has {len}")]
    LayoutMismatch {
        /// Bytes the layout needs (`None`: it overflows).
        layout_bytes: Option<u64>,
        /// Bytes of the buffer.
        len: u64,
    },
    /// The raw handle is not of the kind its backend exports.
    #[error("handle says backend {backend:?} but carries a {raw} raw handle")]
    BackendMismatch {
        /// The backend the handle names.
        backend: BackendKind,
        /// The kind of raw handle it carries.
        raw: &'static str,
    },
    /// The handle's digest does not verify under this session's key.
    #[error(
        "handle digest does not verify: the handle was corrupted in transit or sealed with another session's token"
    )]
    DigestMismatch,
}
