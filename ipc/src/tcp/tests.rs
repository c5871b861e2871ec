//! Host links on loopback: messages both ways, the refusals (wrong token, unpinned key,
//! changed bytes, descriptors), and rogue clients against the listener while an honest
//! one gets through.

use super::*;
use baton_messages::SessionToken;

fn session(b: u8) -> Session {
    Session::new(SessionToken::from_bytes([b; 32]))
}

fn config(b: u8) -> TcpConfig {
    TcpConfig::new(session(b), NodeKey::generate().unwrap())
        .handshake_timeout(Duration::from_secs(5))
}

fn listen(config: TcpConfig) -> HostListener {
    HostListener::bind("127.0.0.1:0", config).unwrap()
}

/// Connects and accepts: (client, server).
fn pair(server: TcpConfig, client: &TcpConfig) -> (Result<HostLink>, Result<HostLink>) {
    let listener = listen(server);
    let c = HostLink::connect(listener.local_addr(), client);
    let s = listener.accept_timeout(Duration::from_secs(10));
    (c, s)
}

#[test]
fn messages_cross_both_ways_and_each_side_knows_the_other() {
    let server = config(1);
    let client = config(1);
    let (c, s) = pair(server.clone(), &client);
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    // Each side knows the other by its claim in its proven key's namespace.
    assert_eq!(c.peer().claimed, crate::process::current());
    assert_eq!(
        c.peer().process,
        remote_process(&server.key.public(), crate::process::current())
    );
    assert_eq!(
        s.peer().process,
        remote_process(&client.key.public(), crate::process::current())
    );
    assert_eq!(c.peer().key, server.key.public());
    assert_eq!(s.peer().key, client.key.public());
    assert_eq!(s.peer().host, HostId::current());
    c.send(&Message::Ping(1), &[]).unwrap();
    assert_eq!(s.recv().unwrap().message, Message::Ping(1));
    s.send(&Message::Pong(2), &[]).unwrap();
    assert_eq!(c.recv().unwrap().message, Message::Pong(2));
    // A frame larger than one Noise message is carried as several and reassembled.
    let big = Message::Refused(Refused {
        reason: RefuseReason::BadToken,
    });
    let mut frames = Vec::new();
    for i in 0..20_000 {
        encode_frame(&Message::Ping(i), 0, &mut frames).unwrap();
    }
    assert!(frames.len() > 3 * noise::MAX_PLAINTEXT);
    c.send_encoded(&frames).unwrap();
    for i in 0..20_000 {
        assert_eq!(s.recv().unwrap().message, Message::Ping(i));
    }
    s.send(&big, &[]).unwrap();
    assert_eq!(c.recv().unwrap().message, big);
    drop(c);
    assert!(matches!(s.recv(), Err(Error::Closed)));
}

#[test]
fn a_wrong_token_is_refused_before_any_message_on_both_sides() {
    let (c, s) = pair(config(1), &config(2));
    let s = s.unwrap_err();
    assert!(matches!(s, Error::BadToken), "server: {s}");
    let c = c.unwrap_err();
    assert!(
        matches!(
            c,
            Error::Refused {
                reason: RefuseReason::BadToken
            }
        ),
        "client: {c}"
    );
}

#[test]
fn a_key_outside_the_pinned_set_is_refused() {
    // The listener pins another key than the client's.
    let stranger = NodeKey::generate().unwrap().public();
    let (c, s) = pair(config(1).policy(TcpPolicy::pinned([stranger])), &config(1));
    assert!(
        matches!(s, Err(Error::HostKeyNotPinned { .. })),
        "server: {s:?}"
    );
    assert!(
        matches!(
            c,
            Err(Error::Refused {
                reason: RefuseReason::NotAllowed
            })
        ),
        "client: {c:?}"
    );
    // The client pins another key than the listener's.
    let (c, s) = pair(config(1), &config(1).policy(TcpPolicy::pinned([stranger])));
    assert!(
        matches!(c, Err(Error::HostKeyNotPinned { .. })),
        "client: {c:?}"
    );
    assert!(s.is_err(), "server: {s:?}");
    // Pinned right, both ways: established.
    let (server, client) = (config(1), config(1));
    let (c, s) = pair(
        server
            .clone()
            .policy(TcpPolicy::pinned([client.key.public()])),
        &client.policy(TcpPolicy::pinned([server.key.public()])),
    );
    assert!(c.is_ok() && s.is_ok());
}

#[test]
fn a_changed_byte_in_a_transport_message_is_refused_as_tampered() {
    let listener = listen(config(1));
    let flip = Arc::new(AtomicBool::new(false));
    let (proxy, _) = proxy::proxy(
        listener.local_addr(),
        proxy::Flip::WhenArmed(Arc::clone(&flip)),
        None,
    );
    let mut c = HostLink::connect(proxy, &config(1)).unwrap();
    let mut s = listener.accept_timeout(Duration::from_secs(10)).unwrap();
    c.send(&Message::Ping(1), &[]).unwrap();
    assert_eq!(s.recv().unwrap().message, Message::Ping(1));
    flip.store(true, Ordering::SeqCst);
    c.send(&Message::Ping(2), &[]).unwrap();
    let e = s.recv().unwrap_err();
    assert!(matches!(e, Error::Tampered { .. }), "{e}");
}

#[test]
fn frames_with_descriptors_cannot_cross() {
    let (c, s) = pair(config(1), &config(1));
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    let file = tempfile::tempfile().unwrap();
    assert!(matches!(
        c.send(&Message::Ping(1), &[file.as_fd()]),
        Err(Error::DescriptorsOverTcp { nfds: 1 })
    ));
    // A frame that announces one, sent anyway: the receiver refuses it.
    let frame = baton_messages::codec::frame_bytes(&Message::Ping(2), 1).unwrap();
    c.send_encoded(&frame).unwrap();
    assert!(matches!(
        s.recv(),
        Err(Error::MissingFds { need: 1, have: 0 })
    ));
}

#[test]
fn rogue_clients_leave_an_honest_one_unharmed() {
    let listener = listen(
        config(1)
            .handshake_timeout(Duration::from_millis(500))
            .max_handshakes(32),
    );
    let addr = listener.local_addr();
    let mut rogues = Vec::new();
    // Random bytes.
    for i in 0..8u8 {
        let mut s = TcpStream::connect(addr).unwrap();
        let junk: [u8; 64] = crate::session::random_bytes().unwrap();
        let _ = s.write_all(&junk[..usize::from(8 + i)]);
        rogues.push(s);
    }
    // A record that claims the largest length, and never sends it.
    for _ in 0..4 {
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&[0xff, 0xff, 1, 2, 3]);
        rogues.push(s);
    }
    // Truncation mid-handshake: a valid first message, then the connection closed.
    for _ in 0..4 {
        let s = TcpStream::connect(addr).unwrap();
        let cfg = config(1);
        let (_, first) = Handshake::initiator(&cfg).unwrap();
        (&s).write_all(&first[..first.len() / 2]).unwrap();
        drop(s);
    }
    // A thousand silent connections.
    for _ in 0..1000 {
        if let Ok(s) = TcpStream::connect(addr) {
            rogues.push(s);
        }
    }
    // The honest client, retrying while the cap is full, gets through.
    let honest = config(1);
    let until = Instant::now() + Duration::from_secs(30);
    let mut c = loop {
        match HostLink::connect(addr, &honest) {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    Instant::now() < until,
                    "the honest client never got in: {e}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let mut s = loop {
        match listener.accept_timeout(Duration::from_secs(10)) {
            Ok(s) if s.peer().key == honest.key.public() => break s,
            Ok(_) => {}
            Err(Error::Timeout {
                op: "accepting a host link",
                ..
            }) => panic!("the honest link was never accepted"),
            Err(_) => {} // a rogue's refusal
        }
    };
    c.send(&Message::Ping(7), &[]).unwrap();
    assert_eq!(s.recv().unwrap().message, Message::Ping(7));
    s.send(&Message::Pong(8), &[]).unwrap();
    assert_eq!(c.recv().unwrap().message, Message::Pong(8));
    drop(rogues);
}

#[test]
fn async_halves_carry_messages_both_ways() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let listener = Arc::new(listen(config(1)));
    let addr = listener.local_addr();
    rt.block_on(async {
        let accepting = {
            let l = Arc::clone(&listener);
            tokio::task::spawn_blocking(move || l.accept_timeout(Duration::from_secs(10)))
        };
        let c = AsyncHostLink::connect(addr, &config(1)).await.unwrap();
        let s = AsyncHostLink::from_blocking(accepting.await.unwrap().unwrap()).unwrap();
        let closer = s.closer();
        let (mut srx, mut swx) = s.into_split();
        let (mut crx, mut cwx) = c.into_split();
        cwx.send(&Message::Ping(3), &[]).await.unwrap();
        assert_eq!(srx.recv().await.unwrap().message, Message::Ping(3));
        swx.send(&Message::Pong(4), &[]).await.unwrap();
        assert_eq!(crx.recv().await.unwrap().message, Message::Pong(4));
        let file = tempfile::tempfile().unwrap();
        assert!(matches!(
            cwx.send(&Message::Ping(5), &[file.as_fd()]).await,
            Err(Error::DescriptorsOverTcp { nfds: 1 })
        ));
        assert!(!closer.readable_now());
        cwx.shutdown();
        assert!(matches!(srx.recv().await, Err(Error::Closed)));
    });
}

#[test]
fn an_accepted_links_place_is_given_back_once_both_async_halves_are_gone() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let listener = listen(config(1).max_links(1, 1));
    let addr = listener.local_addr();
    let client = config(1);
    let _c = HostLink::connect(addr, &client).unwrap();
    let s = listener.accept_timeout(Duration::from_secs(10)).unwrap();
    rt.block_on(async {
        let (reader, writer) = AsyncHostLink::from_blocking(s).unwrap().into_split();
        // Held: the listener is full.
        assert!(matches!(
            HostLink::connect(addr, &config(1)),
            Err(Error::Refused {
                reason: RefuseReason::TooManyLinks
            })
        ));
        assert!(matches!(
            listener.accept_timeout(Duration::from_secs(10)),
            Err(Error::TooManyHostLinks { limit: 1, .. })
        ));
        drop(reader);
        // One half still holds it.
        assert!(HostLink::connect(addr, &config(1)).is_err());
        assert!(listener.accept_timeout(Duration::from_secs(10)).is_err());
        drop(writer);
    });
    assert!(HostLink::connect(addr, &config(1)).is_ok());
    assert!(listener.accept_timeout(Duration::from_secs(10)).is_ok());
}
