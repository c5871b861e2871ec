//! Who a remote peer is: its claim in its proven key's namespace (findings 1 and 9).
//!
//! A token holder over TCP proves its static key and the token, nothing else: the
//! process and boot id it announces are claims. Here it claims a live local process (and
//! leaves, which ended that process's leases before), or another host's boot id (which
//! cut every link of that host before): the claim names nothing but its own key's
//! processes, so neither touches anybody else.

use crate::actors::{DEADLINE, Parent, eventually, run};
use crate::msgs::{Hold, PeekHeld, pattern};
use baton::Session;
use baton::actors::{HostSettings, Node, NodeConfig};
use baton::ipc::HostBackend;
use baton::ipc::tcp::{HostId, remote_process};
use baton::messages::{BootId, ProcessId};
use std::sync::Arc;

/// A node of `session` on host `host`, with host memory.
fn node(session: Session, host: &str) -> Node {
    let config = NodeConfig::new(session).hosts(HostSettings {
        host: HostId::named(host),
        ..HostSettings::default()
    });
    Node::with_config(config, Arc::new(HostBackend::new().unwrap()))
}

/// Finding 1: a token holder claims a live local process's id over TCP, then disconnects.
/// Before, the node took the link's end for that process's death: its leases ended and
/// its memory could be freed while it still mapped it. Now the claim names a process of
/// the liar's key, which is no local process: the local holder keeps its lease and reads
/// its data, and the buffer is not returned.
#[test]
fn a_token_holder_claiming_a_local_process_over_tcp_ends_none_of_its_leases() {
    run(async {
        let parent = Parent::start("hi-claim-local");
        let (mut child, holder) = parent.child(&[]).await;
        let buf = parent.pattern_buffer(1024, 7).await;
        let held = holder
            .remote::<Hold>("holder")
            .send(Hold {
                buffers: vec![buf.share()],
            })
            .await
            .unwrap();
        assert_eq!(held, 1);
        let victim = holder.process();

        let mut listening = parent.node.listen_tcp("127.0.0.1:0").unwrap();
        let liar = node(parent.session.clone().claiming(victim), "hi-liar");
        let to_parent = liar.connect_tcp(listening.local_addr()).await.unwrap();
        let seen = listening.accept_timeout(DEADLINE).await.unwrap();
        let proven = seen.info().host().expect("a host link");
        assert_eq!(proven.claimed, victim, "the liar announced the victim");
        assert_eq!(seen.process(), remote_process(&proven.key, victim));
        assert_ne!(seen.process(), victim, "and is known as its key's process");

        // It leaves. The node handles the end of its last link (and anything it does for
        // the process it names) before it tells subscribers the link is down.
        to_parent.close_and_wait().await;
        eventually(DEADLINE, "the liar's link down at the parent", || {
            parent.events.down_reason(seen.link_id()).is_some()
        })
        .await;

        let table = parent.table().await;
        assert_eq!(table.len(), 1);
        assert_eq!(
            table[0]
                .leases
                .iter()
                .map(|(_, p)| p.pid)
                .collect::<Vec<_>>(),
            vec![child.pid()],
            "the victim's lease stands"
        );
        assert!(holder.is_connected(), "the victim's link is untouched");
        let seen_data = holder
            .remote::<PeekHeld>("holder.peek")
            .send(PeekHeld)
            .await
            .unwrap();
        assert_eq!(seen_data, vec![pattern(7, 0)], "and it reads its data");
        let stats = parent.stats().await;
        assert_eq!(stats.leases, 1, "the lease is still out");

        holder.close();
        crate::actors::exited(&mut child, DEADLINE).await;
        buf.returned_within(DEADLINE)
            .await
            .expect("returned once the real holder is gone");
    });
}

/// Finding 9: a forged boot id under a host's id. A second key that says it runs on host
/// "hi-b" with another boot id announced a reboot of that host: every link of the host
/// was cut and its leases voided. Now a boot id is only its own key's to change: the
/// honest link of "hi-b" stays up — a ping sent after the forger's link came up (so after
/// any cut the node would have queued for it) comes back.
#[test]
fn a_forged_boot_id_under_another_hosts_id_cuts_nothing_of_that_host() {
    run(async {
        let session = Session::generate().unwrap();
        let ours = node(session.clone(), "hi-a");
        let honest = node(session.clone(), "hi-b");
        let mut listening = ours.listen_tcp("127.0.0.1:0").unwrap();
        let honest_link = honest.connect_tcp(listening.local_addr()).await.unwrap();
        let honest_seen = listening.accept_timeout(DEADLINE).await.unwrap();

        let rebooted = ProcessId {
            boot: BootId([0x5a; 16]),
            ..honest.session().process()
        };
        let forger = node(session.clone().claiming(rebooted), "hi-b");
        let _forger_link = forger.connect_tcp(listening.local_addr()).await.unwrap();
        let forger_seen = listening.accept_timeout(DEADLINE).await.unwrap();
        let (h, f) = (
            honest_seen.info().host().unwrap(),
            forger_seen.info().host().unwrap(),
        );
        assert_eq!(h.host, f.host, "both say they run on hi-b");
        assert_ne!(h.claimed.boot, f.claimed.boot, "on different boots");

        honest_seen
            .ping()
            .await
            .expect("the honest link of hi-b answers after the forger came up");
        assert!(honest_seen.is_connected());
        honest_link
            .ping()
            .await
            .expect("and the honest side's link too");

        // The same key coming back with a new boot id (a real reboot, a pinned key) still
        // voids its old incarnation: tested beside `stale_incarnations` in node.rs.
    });
}
