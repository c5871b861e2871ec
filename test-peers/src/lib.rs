//! The helper processes of Baton's cross-process tests: the binaries that the facade's
//! tests (`tests/*.rs` at the repository root) spawn as the other end of a link. Never
//! published; this library holds only this page.
//!
//! | binary | role | spawned by |
//! |---|---|---|
//! | `baton-test-peer` | a raw link client or server, one role per invocation | `host_link`, `link_bad_input`, `process_tree`, `auth`, `soak`, … |
//! | `baton-actor-peer` | a node with the test actors, cooperative or stubborn | the actor tests (`tests/support/actors.rs`) |
//! | `baton-flood-peer` | a correct peer that floods a node | `bounds` |
//! | `baton-conformance-peer` | one backend role for the conformance suite | `conformance` |
//! | `baton-relay-peer` | a relay (B) and a sink (C) | `forwarding` |
//! | `baton-ordering-peer` | a CUDA importer with a stream of its own | `ordering_cuda` |
//! | `baton-api-peer` | a child started with `Node::spawn_child` | `api` |
//! | `baton-host-peer` | a node on another host (`BATON_HOST_ID`) linked over TCP, or a forger with the raw `HostLink` client | `cross_host_procs`, `cross_host_netns` |
//! | `baton-agent-peer` | a child agent on another host, its children, or a supervisor of children there | `remote_supervision` |
//!
//! The messages a helper and its tests share live beside the tests
//! (`tests/support/msgs.rs` and the like) and are included by path on both sides.
//!
//! # Why a package of their own
//!
//! They used to be `[[bin]]`s of the facade (`src/bin`), so `cargo install baton` installed
//! them and the published package shipped them. Of the two ways out — an unpublished
//! member, or the test binary re-run with a role argument — this is the first: every helper
//! serves several test binaries, the supervision tests start them by path as a real child
//! would be started, `auth` copies one to run it as another user, and each keeps its own
//! small `main` and `--help`.
//!
//! # How the tests find them
//!
//! `cargo test` builds only the binaries of the package under test, so `env!("CARGO_BIN_EXE_…")`
//! cannot name these. `tests/support/built.rs` does instead: on its first call in a test
//! process it runs `cargo build -p baton-test-peers --bins` in the test's own profile, target
//! directory and `gpu-tests` feature (a no-op when they are up to date), then returns
//! `<target>/<profile>/<name>`, where cargo puts them. When the test binary runs outside
//! cargo (no `CARGO` in its environment) and the binary is already there, as on a GPU
//! machine without a Rust toolchain that runs a prebuilt bundle (`cargo build --workspace
//! --bins` puts them at the same paths), it is used as it is.

/// A helper's first steps as a child: takes the session token (and closes its pipe) before
/// anything else — exiting with `name: why` if there is none — then logs to stderr as
/// `RUST_LOG` asks, without colour codes unless stderr is a terminal.
pub fn start(name: &str) -> baton::Session {
    let session = match baton::Session::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{name}: {e}");
            std::process::exit(1);
        }
    };
    tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    session
}
