//! The ring against a model, against a forging peer, across a killed process and on tokio.
//! Every wait has a deadline; no test asserts how long anything took.

use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

/// Any wait's deadline: far beyond what a passing test needs.
const WAIT: Duration = Duration::from_secs(20);

fn soon() -> Instant {
    Instant::now() + WAIT
}

fn pair(capacity: usize) -> (RingReader, RingWriter) {
    let (reader, fds) = RingReader::create(capacity, PollWindow::for_this_machine()).unwrap();
    (reader, RingWriter::open(fds).unwrap())
}

/// A ring, its writer, and a second mapping of its memory to forge words through.
fn forgeable(capacity: usize) -> (RingReader, RingWriter, RingMap) {
    let (reader, fds) = RingReader::create(capacity, PollWindow::never()).unwrap();
    let forge = RingMap::map(fds.memory.as_fd(), HEADER_SIZE + capacity).unwrap();
    (reader, RingWriter::open(fds).unwrap(), forge)
}

/// Frame `i` of length `len`: recognisable, different from its neighbours.
fn frame(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j) as u8).collect()
}

fn recv_now(reader: &mut RingReader) -> Result<Option<(Entry, Vec<u8>)>, RingError> {
    let mut out = Vec::new();
    Ok(reader.try_recv(&mut out)?.map(|e| (e, out)))
}

fn forge_tail(forge: &RingMap, tail: u64) {
    forge.header().tail.0.store(tail, Ordering::Release);
}

fn assert_corrupt<T: fmt::Debug>(r: Result<T, RingError>, what: &str) {
    assert!(matches!(r, Err(RingError::Corrupt(_))), "{what}: {r:?}");
}

// --- The model ---

#[derive(Debug, Clone)]
enum Op {
    Send(usize),
    Marker,
    Recv,
    Hold,
    Flush,
    Publish,
}

fn ops(max: usize) -> impl Strategy<Value = Vec<Op>> {
    // Lengths that end records exactly at the end (1016: a quarter ring; 2040: the
    // maximum, half a ring; 504: an eighth), any length, and lengths over the maximum.
    let len = prop_oneof![
        4 => 0..=max,
        1 => prop::sample::select(vec![0, 504, 1016, 2040, 2032, 8]),
        1 => max + 1..max + 64,
    ];
    prop::collection::vec(
        prop_oneof![
            4 => len.prop_map(Op::Send),
            1 => Just(Op::Marker),
            4 => Just(Op::Recv),
            1 => Just(Op::Hold),
            1 => Just(Op::Flush),
            1 => Just(Op::Publish),
        ],
        1..300,
    )
}

/// What the model holds: each entry (a frame's bytes or a marker) and the bytes it takes
/// in the ring, wrap marker included; how many of the first entries the reader may see
/// (the rest are held back), and whether appends are held.
struct Model {
    capacity: u64,
    head: u64,
    tail: u64,
    entries: VecDeque<(Option<Vec<u8>>, u64)>,
    visible: usize,
    held: bool,
}

impl Model {
    /// The bytes an entry of `len` takes if appended now (its wrap marker's skip included).
    fn cost(&self, len: usize) -> u64 {
        let size = entry_size(len) as u64;
        let to_end = self.capacity - self.tail % self.capacity;
        if size > to_end { to_end + size } else { size }
    }

    fn fits(&self, len: usize) -> bool {
        self.cost(len) <= self.capacity - (self.tail - self.head)
    }

    fn push(&mut self, entry: Option<Vec<u8>>, len: usize) {
        let cost = self.cost(len);
        self.tail += cost;
        self.entries.push_back((entry, cost));
        if !self.held {
            self.visible = self.entries.len();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random sends, markers, receives, holds and publishes against a queue: every entry
    /// comes out whole and in order, none held back before it is published, `Full` exactly
    /// when the entry does not fit (never on an empty ring), `TooLarge` exactly above the
    /// maximum; records ending exactly at the end included.
    #[test]
    fn the_ring_behaves_as_a_bounded_queue(ops in ops(max_frame_of(MIN_CAPACITY))) {
        let (mut reader, mut writer) = pair(MIN_CAPACITY);
        let max = writer.max_frame();
        let mut model = Model {
            capacity: MIN_CAPACITY as u64,
            head: 0,
            tail: 0,
            entries: VecDeque::new(),
            visible: 0,
            held: false,
        };
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Send(len) => {
                    let bytes = frame(i as u64, len);
                    let r = writer.try_send(&bytes);
                    if len > max {
                        prop_assert!(matches!(r, Err(RingError::TooLarge { .. })), "{r:?}");
                    } else if model.fits(len) {
                        prop_assert!(r.is_ok(), "{r:?}");
                        model.push(Some(bytes), len);
                    } else {
                        prop_assert!(!model.entries.is_empty());
                        prop_assert!(matches!(r, Err(RingError::Full)), "{r:?}");
                    }
                }
                Op::Marker => {
                    let r = writer.try_send_marker();
                    if model.fits(0) {
                        prop_assert!(r.is_ok(), "{r:?}");
                        model.push(None, 0);
                    } else {
                        prop_assert!(matches!(r, Err(RingError::Full)), "{r:?}");
                    }
                }
                Op::Hold => {
                    writer.hold();
                    model.held = true;
                }
                Op::Flush | Op::Publish => {
                    if matches!(op, Op::Flush) {
                        writer.flush();
                    } else {
                        writer.publish();
                        model.held = false;
                    }
                    model.visible = model.entries.len();
                }
                Op::Recv => {
                    let got = recv_now(&mut reader).unwrap();
                    let next = if model.visible > 0 {
                        model.visible -= 1;
                        model.entries.pop_front()
                    } else {
                        None
                    };
                    match next {
                        None => prop_assert!(got.is_none()),
                        Some((want, cost)) => {
                            model.head += cost;
                            let (entry, bytes) = got.expect("an entry");
                            match want {
                                Some(want) => {
                                    prop_assert_eq!(entry, Entry::Frame { len: want.len() });
                                    prop_assert_eq!(bytes, want);
                                }
                                None => prop_assert_eq!(entry, Entry::Socket),
                            }
                        }
                    }
                }
            }
            prop_assert_eq!(reader.has_frame(), model.visible > 0);
            prop_assert_eq!(writer.is_held(), model.held);
        }
        // Everything still in the ring comes out too, once published.
        writer.publish();
        while let Some((want, _)) = model.entries.pop_front() {
            let (entry, bytes) = recv_now(&mut reader).unwrap().expect("an entry");
            match want {
                Some(want) => prop_assert_eq!(bytes, want),
                None => prop_assert_eq!(entry, Entry::Socket),
            }
        }
        prop_assert!(recv_now(&mut reader).unwrap().is_none());
    }
}

#[test]
fn records_that_end_exactly_at_the_end_wrap_without_a_marker() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    // Four quarter-ring records fill it exactly: the fourth ends at the end.
    for round in 0..3u64 {
        for i in 0..4 {
            writer.try_send(&frame(round * 4 + i, 1016)).unwrap();
        }
        assert!(matches!(writer.try_send_marker(), Err(RingError::Full)));
        for i in 0..4 {
            let (_, bytes) = recv_now(&mut reader).unwrap().unwrap();
            assert_eq!(bytes, frame(round * 4 + i, 1016));
        }
        assert!(recv_now(&mut reader).unwrap().is_none());
    }
    // Two maximal frames fill it exactly, whatever came before.
    for i in 0..5 {
        writer.try_send(&frame(i, writer.max_frame())).unwrap();
        writer.try_send(&frame(i + 1, writer.max_frame())).unwrap();
        assert!(matches!(writer.try_send(&[]), Err(RingError::Full)));
        for j in 0..2 {
            let (_, bytes) = recv_now(&mut reader).unwrap().unwrap();
            assert_eq!(bytes, frame(i + j, reader.max_frame()));
        }
    }
}

#[test]
fn a_maximal_frame_fits_an_empty_ring_wherever_its_tail_is() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    let max = writer.max_frame();
    assert_eq!(max, MIN_CAPACITY / 2 - 8);
    for i in 0..64u64 {
        // Move the tail by a little each time, so that a maximal frame starts everywhere.
        writer.try_send(&frame(i, (i as usize * 40) % 600)).unwrap();
        writer.try_send(&frame(i, max)).unwrap();
        recv_now(&mut reader).unwrap().unwrap();
        let (entry, bytes) = recv_now(&mut reader).unwrap().unwrap();
        assert_eq!(entry, Entry::Frame { len: max });
        assert_eq!(bytes, frame(i, max));
    }
}

#[test]
fn a_full_ring_says_full_and_a_huge_frame_too_large() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    let max = writer.max_frame();
    assert!(matches!(
        writer.try_send(&vec![0; max + 1]),
        Err(RingError::TooLarge { len, max: m }) if len == max + 1 && m == max
    ));
    let mut sent = 0;
    while writer.try_send(&[7; 100]).is_ok() {
        sent += 1;
    }
    assert!(matches!(writer.try_send(&[7; 100]), Err(RingError::Full)));
    // A sender with a deadline is told Full at it.
    let r = writer.send(&[7; 100], Instant::now() + Duration::from_millis(20));
    assert!(matches!(r, Err(RingError::Full)), "{r:?}");
    assert_eq!(sent, MIN_CAPACITY / 112);
    recv_now(&mut reader).unwrap().unwrap();
    writer.try_send(&[7; 100]).unwrap();
}

#[test]
fn capacities_are_checked() {
    for bad in [0, 100, MIN_CAPACITY / 2, MIN_CAPACITY + 8, MAX_CAPACITY * 2] {
        let r = RingReader::create(bad, PollWindow::never());
        assert!(
            matches!(r, Err(RingError::BadCapacity(c)) if c == bad),
            "{bad}"
        );
    }
    for good in [MIN_CAPACITY, DEFAULT_CAPACITY, MAX_CAPACITY] {
        let (reader, fds) = RingReader::create(good, PollWindow::never()).unwrap();
        let writer = RingWriter::open(fds).unwrap();
        assert_eq!((reader.capacity(), writer.capacity()), (good, good));
    }
}

// --- A peer that forges the shared words ---

#[test]
fn forged_tails_are_corrupt() {
    let (mut reader, _writer, forge) = forgeable(MIN_CAPACITY);
    forge_tail(&forge, 3);
    assert_corrupt(recv_now(&mut reader), "unaligned tail");
    // For good: a sane tail later does not heal it.
    forge_tail(&forge, 0);
    assert_corrupt(recv_now(&mut reader), "poisoned");

    let (mut reader, _writer, forge) = forgeable(MIN_CAPACITY);
    forge_tail(&forge, MIN_CAPACITY as u64 + 8);
    assert_corrupt(recv_now(&mut reader), "tail more than a ring ahead");

    let (mut reader, mut writer, forge) = forgeable(MIN_CAPACITY);
    writer.try_send(&[1; 8]).unwrap();
    writer.try_send(&[2; 8]).unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    forge_tail(&forge, 16);
    assert_corrupt(recv_now(&mut reader), "tail moved backwards to head");

    let (mut reader, _writer, forge) = forgeable(MIN_CAPACITY);
    forge_tail(&forge, 4);
    assert_corrupt(recv_now(&mut reader), "tail inside a record header");
}

#[test]
fn forged_records_are_corrupt() {
    let cap = MIN_CAPACITY;
    let forged = |rec: [u8; RECORD], tail: u64| {
        let (mut reader, _writer, forge) = forgeable(cap);
        forge.write_data(0, &rec);
        forge_tail(&forge, tail);
        recv_now(&mut reader)
    };
    assert_corrupt(
        forged(record(cap as u32, KIND_FRAME), cap as u64),
        "length over the max",
    );
    assert_corrupt(forged(record(u32::MAX, KIND_FRAME), 16), "huge length");
    assert_corrupt(forged(record(100, KIND_FRAME), 16), "frame past tail");
    assert_corrupt(forged(record(0, 0), 8), "zeroed record");
    assert_corrupt(forged(record(0, 77), 8), "unknown kind");
    assert_corrupt(forged(record(8, KIND_SOCKET), 16), "marker with a length");
    assert_corrupt(forged(record(0, KIND_WRAP), 16), "wrap marker at 0");

    // A frame that straddles the end, and a wrap marker with nothing after it.
    let (mut reader, mut writer, forge) = forgeable(cap);
    writer.try_send(&[0; 2040]).unwrap();
    writer.try_send(&[0; 1016]).unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    forge.write_data(3072, &record(2000, KIND_FRAME));
    forge_tail(&forge, 3072 + 2008);
    assert_corrupt(recv_now(&mut reader), "frame straddles the end");

    let (mut reader, mut writer, forge) = forgeable(cap);
    writer.try_send(&[0; 2040]).unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    forge.write_data(2048, &record(0, KIND_WRAP));
    forge_tail(&forge, cap as u64);
    assert_corrupt(recv_now(&mut reader), "wrap marker with nothing after it");

    let (mut reader, mut writer, forge) = forgeable(cap);
    writer.try_send(&[0; 2040]).unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    forge.write_data(2048, &record(8, KIND_WRAP));
    forge_tail(&forge, cap as u64 + 8);
    assert_corrupt(recv_now(&mut reader), "wrap marker with a length");
}

#[test]
fn a_forged_head_is_corrupt_for_the_writer() {
    let (_reader, mut writer, forge) = forgeable(MIN_CAPACITY);
    forge.header().head.0.store(8, Ordering::Release);
    assert_corrupt(writer.try_send(&[1]), "head passed tail");
    assert_corrupt(writer.try_send(&[1]), "poisoned");

    let (_reader, mut writer, forge) = forgeable(MIN_CAPACITY);
    writer.try_send(&[1; 16]).unwrap();
    forge.header().head.0.store(4, Ordering::Release);
    assert_corrupt(writer.try_send(&[1]), "unaligned head");

    let (mut reader, mut writer, forge) = forgeable(MIN_CAPACITY);
    writer.try_send(&[1; 16]).unwrap();
    recv_now(&mut reader).unwrap().unwrap();
    writer.try_send(&[1; 16]).unwrap();
    forge.header().head.0.store(0, Ordering::Release);
    assert_corrupt(writer.try_send(&[1]), "head moved backwards");
}

// --- What `RingWriter::open` refuses ---

fn bell() -> OwnedFd {
    rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap()
}

fn memfd(len: usize, seals: SealFlags) -> OwnedFd {
    let fd =
        rustix::fs::memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, len as u64).unwrap();
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    fd
}

fn assert_not_a_ring(fds: RingFds, what: &str) {
    let r = RingWriter::open(fds);
    assert!(matches!(r, Err(RingError::NotARing)), "{what}: {r:?}");
}

#[test]
fn open_refuses_what_is_not_a_ring() {
    let len = HEADER_SIZE + MIN_CAPACITY;
    let with = |memory| RingFds {
        memory,
        doorbell: bell(),
        space: bell(),
    };
    assert_not_a_ring(with(memfd(len, SealFlags::empty())), "unsealed memfd");
    assert_not_a_ring(with(memfd(len, SealFlags::SHRINK)), "memfd that can grow");
    assert_not_a_ring(with(memfd(len, SEALS)), "sealed memfd without a header");
    assert_not_a_ring(
        with(memfd(len + 8, SEALS)),
        "sealed memfd of no ring's size",
    );
    let file = tempfile::tempfile().unwrap();
    file.set_len(len as u64).unwrap();
    assert_not_a_ring(with(file.into()), "a regular file as memory");

    // A real ring with one thing wrong.
    let ring = |forge_it: &dyn Fn(&RingMap)| {
        let (reader, fds) = RingReader::create(2 * MIN_CAPACITY, PollWindow::never()).unwrap();
        let forge = RingMap::map(fds.memory.as_fd(), HEADER_SIZE + 2 * MIN_CAPACITY).unwrap();
        forge_it(&forge);
        (reader, fds)
    };
    let (_r, fds) = ring(&|m| m.header().ident.0.magic.store(1, Ordering::Release));
    assert_not_a_ring(fds, "bad magic");
    let (_r, fds) = ring(&|m| m.header().ident.0.version.store(9, Ordering::Release));
    assert_not_a_ring(fds, "another version");
    let cap = MIN_CAPACITY as u64;
    let (_r, fds) = ring(&|m| m.header().ident.0.capacity.store(cap, Ordering::Release));
    assert_not_a_ring(fds, "capacity that does not match the size");
    let (_r, fds) = ring(&|m| {
        m.header()
            .ident
            .0
            .capacity
            .store(cap + 1, Ordering::Release)
    });
    assert_not_a_ring(fds, "capacity not a power of two");

    // Bells that are not eventfds.
    let (_r, fds) = ring(&|_| ());
    let (pipe_r, _pipe_w) = rustix::pipe::pipe().unwrap();
    assert_not_a_ring(
        RingFds {
            doorbell: pipe_r,
            ..fds
        },
        "a pipe as the doorbell",
    );
    let (_r, fds) = ring(&|_| ());
    assert_not_a_ring(
        RingFds {
            space: tempfile::tempfile().unwrap().into(),
            ..fds
        },
        "a regular file as the space bell",
    );
    let (_r, fds) = ring(&|_| ());
    assert_not_a_ring(
        RingFds {
            doorbell: fds.memory.try_clone().unwrap(),
            ..fds
        },
        "the memory as the doorbell",
    );
    // And the real thing opens.
    let (_r, fds) = ring(&|_| ());
    RingWriter::open(fds).unwrap();
}

#[test]
fn the_memory_has_no_name_to_leave_behind() {
    let (_reader, fds) = RingReader::create(MIN_CAPACITY, PollWindow::never()).unwrap();
    let path = format!("/proc/self/fd/{}", fds.memory.as_raw_fd());
    let link = rustix::fs::readlink(path.as_str(), Vec::new()).unwrap();
    let link = link.to_string_lossy();
    assert!(link.starts_with("/memfd:baton.ring"), "{link}");
}

// --- Blocking waits, closing, one CPU ---

#[test]
fn dropping_the_writer_ends_a_blocked_reader_with_closed() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    writer.try_send(&[1; 10]).unwrap();
    let blocked = std::thread::spawn(move || {
        let mut out = Vec::new();
        let first = reader.recv(&mut out, soon());
        (first.map(|e| e.is_some()), reader.recv(&mut out, soon()))
    });
    // Whether it is blocked yet or not, it must end with Closed, the entry first.
    drop(writer);
    let (first, then) = blocked.join().unwrap();
    assert!(first.unwrap(), "the entry sent before the close");
    assert!(matches!(then, Err(RingError::Closed)), "{then:?}");
}

#[test]
fn dropping_the_reader_ends_a_blocked_writer_with_closed() {
    let (reader, mut writer) = pair(MIN_CAPACITY);
    while writer.try_send(&[1; 500]).is_ok() {}
    let blocked = std::thread::spawn(move || writer.send(&[1; 500], soon()));
    std::thread::sleep(Duration::from_millis(10));
    drop(reader);
    let r = blocked.join().unwrap();
    assert!(matches!(r, Err(RingError::Closed)), "{r:?}");
}

#[test]
fn a_blocked_writer_gets_room_when_the_reader_consumes() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    let sender = std::thread::spawn(move || {
        for i in 0..2000u64 {
            writer
                .send(&frame(i, (i as usize * 13) % 900), soon())
                .unwrap();
        }
    });
    let mut out = Vec::new();
    for i in 0..2000u64 {
        out.clear();
        let entry = reader
            .recv(&mut out, soon())
            .unwrap()
            .expect("before the deadline");
        assert_eq!(
            entry,
            Entry::Frame {
                len: (i as usize * 13) % 900
            }
        );
        assert_eq!(out, frame(i, (i as usize * 13) % 900));
        if i % 500 == 0 {
            // Let the writer fill the ring and wait for room.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    sender.join().unwrap();
}

#[test]
fn a_held_batch_rings_the_doorbell_once_when_published() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    assert!(
        reader.prepare_to_sleep(),
        "an empty ring lets its reader sleep"
    );
    writer.hold();
    for i in 0..3 {
        writer.try_send(&frame(i, 40)).unwrap();
    }
    assert!(!reader.has_frame(), "held frames are not published");
    assert!(
        !drain(reader.doorbell_fd()),
        "no doorbell before the publish"
    );
    writer.publish();
    assert!(
        drain(reader.doorbell_fd()),
        "the publish rings the sleeping reader"
    );
    reader.woke();
    for i in 0..3 {
        assert_eq!(recv_now(&mut reader).unwrap().unwrap().1, frame(i, 40));
    }
    assert!(recv_now(&mut reader).unwrap().is_none());
    // A publish with nothing new rings nothing.
    assert!(reader.prepare_to_sleep());
    writer.publish();
    assert!(!drain(reader.doorbell_fd()));
}

#[test]
fn a_held_writer_waiting_for_room_publishes_first() {
    let (mut reader, mut writer) = pair(MIN_CAPACITY);
    let sender = std::thread::spawn(move || {
        writer.hold();
        // Far more than the ring holds: each wait for room must publish what is held, or
        // the reader never sees a frame and the send ends at its deadline.
        for i in 0..200u64 {
            writer.send(&frame(i, 500), soon()).unwrap();
        }
        writer.publish();
        writer
    });
    let mut out = Vec::new();
    for i in 0..200u64 {
        out.clear();
        reader
            .recv(&mut out, soon())
            .unwrap()
            .expect("before the deadline");
        assert_eq!(out, frame(i, 500));
    }
    drop(sender.join().unwrap());
}

/// Ping-pong between two threads, each ring's reader with the given window.
fn ping_pong(window: PollWindow, round_trips: u64) {
    let (mut a_reader, a_fds) = RingReader::create(MIN_CAPACITY, window).unwrap();
    let (mut b_reader, b_fds) = RingReader::create(MIN_CAPACITY, window).unwrap();
    let (mut to_a, mut to_b) = (
        RingWriter::open(a_fds).unwrap(),
        RingWriter::open(b_fds).unwrap(),
    );
    let echo = std::thread::spawn(move || {
        let mut out = Vec::new();
        for _ in 0..round_trips {
            out.clear();
            b_reader.recv(&mut out, soon()).unwrap().expect("a ping");
            to_a.send(&out, soon()).unwrap();
        }
    });
    let mut out = Vec::new();
    for i in 0..round_trips {
        to_b.send(&frame(i, 215), soon()).unwrap();
        out.clear();
        a_reader.recv(&mut out, soon()).unwrap().expect("a pong");
        assert_eq!(out, frame(i, 215));
    }
    echo.join().unwrap();
}

#[test]
fn ping_pong_with_a_one_cpu_window_never_polls_and_never_misses() {
    assert_eq!(
        PollWindow::with_cpus(1, PollWindow::DEFAULT_MAX),
        PollWindow::never()
    );
    ping_pong(PollWindow::never(), 2000);
}

#[test]
fn ping_pong_with_a_polling_window() {
    ping_pong(PollWindow::new(PollWindow::DEFAULT_MAX), 2000);
}

#[test]
fn a_recv_with_nothing_sent_ends_at_its_deadline() {
    let (mut reader, _writer) = pair(MIN_CAPACITY);
    let r = reader.recv(&mut Vec::new(), Instant::now() + Duration::from_millis(5));
    assert!(matches!(r, Ok(None)), "{r:?}");
}

// --- A writer process killed mid-write ---

/// Kills and reaps a forked child, also when the test fails.
struct Child(rustix::process::Pid);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = rustix::process::kill_process(self.0, rustix::process::Signal::KILL);
        let _ = rustix::process::waitpid(Some(self.0), rustix::process::WaitOptions::empty());
    }
}

fn shm_names() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .filter(|n| n.contains("ring"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_writer_killed_mid_write_leaves_whole_frames_and_nothing_behind() {
    let shm_before = shm_names();
    let (mut reader, fds) = RingReader::create(4 * MIN_CAPACITY, PollWindow::never()).unwrap();
    let mut writer = RingWriter::open(fds).unwrap();
    let len_of = |i: u64| (i as usize * 37) % 1000 + 1;
    // SAFETY: `fork` is one system call. The child (below) only writes the ring, which
    // takes no lock and allocates nothing (atomics, raw copies, raw system calls through
    // rustix), so it is sound in the child of this multi-threaded test process; it never
    // returns: it is killed, or `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut buf = [0u8; 1024];
        for i in 0u64.. {
            let len = len_of(i);
            buf[..8].copy_from_slice(&i.to_le_bytes());
            for (j, b) in buf[8..len.max(8)].iter_mut().enumerate() {
                *b = (i as usize + j) as u8;
            }
            loop {
                match writer.try_send(&buf[..len.max(8)]) {
                    Ok(()) => break,
                    Err(RingError::Full) => std::hint::spin_loop(),
                    // SAFETY: `_exit` ends the child without running anything of the parent's.
                    Err(_) => unsafe { libc::_exit(1) },
                }
            }
        }
        // SAFETY: as above (not reached).
        unsafe { libc::_exit(0) };
    }
    let child = Child(rustix::process::Pid::from_raw(pid).expect("a child"));
    let check = |i: u64, out: &[u8]| {
        assert_eq!(out.len(), len_of(i).max(8), "frame {i}: its length");
        assert_eq!(out[..8], i.to_le_bytes(), "frame {i}: in order");
        for (j, b) in out[8..].iter().enumerate() {
            assert_eq!(*b, (i as usize + j) as u8, "frame {i}: byte {j}");
        }
    };
    let mut out = Vec::new();
    let mut next = 0u64;
    while next < 3000 {
        out.clear();
        reader
            .recv(&mut out, soon())
            .unwrap()
            .expect("the child writes");
        check(next, &out);
        next += 1;
    }
    // Killed while it writes (it always does: the ring is full or nearly).
    drop(child);
    loop {
        out.clear();
        match reader.recv(&mut out, Instant::now() + Duration::from_millis(100)) {
            Ok(Some(_)) => check(next, &out),
            Ok(None) => break,
            Err(e) => panic!("after the kill: {e}"),
        }
        next += 1;
    }
    // The parent's copy of the writer closes it.
    drop(writer);
    let r = reader.recv(&mut out, soon());
    assert!(matches!(r, Err(RingError::Closed)), "{r:?}");
    assert_eq!(shm_names(), shm_before, "nothing named in /dev/shm");
}

// --- tokio ---

fn runtime(hook: bool) -> tokio::runtime::Runtime {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_all();
    if hook {
        b.on_thread_park(before_park);
    }
    b.build().unwrap()
}

/// A writer thread sends `n` frames, pausing now and then so that the reader sleeps; an
/// async reader takes them all in order.
fn async_receive(hook: bool, window: PollWindow) {
    let (reader, fds) = RingReader::create(MIN_CAPACITY, window).unwrap();
    let n = 3000u64;
    let sender = std::thread::spawn(move || {
        let mut writer = RingWriter::open(fds).unwrap();
        for i in 0..n {
            writer
                .send(&frame(i, (i as usize * 7) % 300), soon())
                .unwrap();
            match i % 200 {
                0 => std::thread::sleep(Duration::from_millis(2)),
                1..=20 => std::thread::yield_now(),
                _ => {}
            }
        }
        writer
    });
    let rt = runtime(hook);
    rt.block_on(async {
        let mut ring = AsyncRingReader::new(reader).unwrap();
        let mut out = Vec::new();
        for i in 0..n {
            out.clear();
            let entry = tokio::time::timeout(WAIT, ring.recv(&mut out))
                .await
                .expect("before the deadline")
                .unwrap();
            assert_eq!(entry, Entry::Frame { len: out.len() });
            assert_eq!(out, frame(i, (i as usize * 7) % 300), "frame {i}");
        }
        let writer = sender.join().unwrap();
        drop(writer);
        let r = tokio::time::timeout(WAIT, ring.recv(&mut out))
            .await
            .expect("before the deadline");
        assert!(matches!(r, Err(RingError::Closed)), "{r:?}");
    });
}

#[test]
fn async_recv_with_the_park_hook() {
    async_receive(true, PollWindow::new(PollWindow::DEFAULT_MAX));
    async_receive(true, PollWindow::never());
}

#[test]
fn async_recv_without_the_park_hook() {
    async_receive(false, PollWindow::new(PollWindow::DEFAULT_MAX));
    async_receive(false, PollWindow::never());
}

/// A reader polling through a long window does not hold up a task woken from another
/// thread (a message posted to an actor of the runtime): the hook stops for it. Without
/// that, the task — and the deadline below, a timer — would wait out the 60 s window.
#[test]
fn the_park_hook_stops_polling_for_a_task_woken_from_another_thread() {
    let (mut reader, fds) =
        RingReader::create(MIN_CAPACITY, PollWindow::new(Duration::from_secs(120))).unwrap();
    // A gap of 30 s seen: the window grows to 60 s.
    reader.window_mut().observe(Duration::from_secs(30));
    assert_eq!(reader.window().current(), Duration::from_secs(60));
    let rt = runtime(true);
    let handle = rt.handle().clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let poster = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        handle.spawn(async move {
            let _ = tx.send(());
        });
    });
    rt.block_on(async {
        let mut ring = AsyncRingReader::new(reader).unwrap();
        let mut out = Vec::new();
        tokio::select! {
            r = ring.recv(&mut out) => panic!("nothing was written: {r:?}"),
            posted = tokio::time::timeout(WAIT, rx) => {
                posted.expect("the posted task ran before the deadline").unwrap();
            }
        }
    });
    poster.join().unwrap();
    drop(fds);
}

/// A reader whose window has grown to 60 s: the hook polls its ring for that long, unless
/// it lets the runtime turn.
fn reader_polling_for_a_minute() -> (RingReader, RingFds) {
    let (mut reader, fds) =
        RingReader::create(MIN_CAPACITY, PollWindow::new(Duration::from_secs(120))).unwrap();
    reader.window_mut().observe(Duration::from_secs(30));
    assert_eq!(reader.window().current(), Duration::from_secs(60));
    (reader, fds)
}

/// Waits on the ring (where nothing is written) and on `other` at once: `other` must finish
/// well within the window (half of it; it takes about 50 ms).
async fn while_the_hook_polls(reader: RingReader, other: impl Future<Output = ()>) {
    let started = Instant::now();
    let mut ring = AsyncRingReader::new(reader).unwrap();
    let mut out = Vec::new();
    tokio::select! {
        r = ring.recv(&mut out) => panic!("nothing was written: {r:?}"),
        () = other => {}
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "held up by the poll window: {:?}",
        started.elapsed()
    );
}

/// An actix actor is a task of a `LocalSet`: woken from another thread (a message posted to
/// it), it wakes the runtime's `block_on` future, which tokio's global queue does not show.
/// The hook lets the runtime turn within a slice, so it runs at once, not after the window.
#[test]
fn a_local_task_woken_from_another_thread_runs_while_the_hook_polls() {
    let (reader, fds) = reader_polling_for_a_minute();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let poster = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let _ = tx.send(());
    });
    let rt = runtime(true);
    tokio::task::LocalSet::new().block_on(&rt, async {
        let local = tokio::task::spawn_local(async move { rx.await.unwrap() });
        while_the_hook_polls(reader, async move { local.await.unwrap() }).await;
    });
    poster.join().unwrap();
    drop(fds);
}

/// Timers and sockets other than doorbells are seen while the hook polls.
#[test]
fn timers_and_sockets_are_seen_while_the_hook_polls() {
    let (reader, fds) = reader_polling_for_a_minute();
    runtime(true).block_on(while_the_hook_polls(reader, async {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }));
    let (reader, fds2) = reader_polling_for_a_minute();
    let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
    let poster = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        std::io::Write::write_all(&mut b, b"x").unwrap();
        b
    });
    let rt = runtime(true);
    rt.block_on(async {
        a.set_nonblocking(true).unwrap();
        let a = tokio::net::UnixStream::from_std(a).unwrap();
        while_the_hook_polls(reader, async move { a.readable().await.unwrap() }).await;
    });
    drop(poster.join().unwrap());
    drop((fds, fds2));
}

#[test]
fn async_ping_pong_on_two_runtimes_with_the_hook() {
    let (a_reader, a_fds) =
        RingReader::create(MIN_CAPACITY, PollWindow::for_this_machine()).unwrap();
    let (b_reader, b_fds) =
        RingReader::create(MIN_CAPACITY, PollWindow::for_this_machine()).unwrap();
    let n = 2000u64;
    let echo = std::thread::spawn(move || {
        runtime(true).block_on(async {
            let mut to_a = RingWriter::open(a_fds).unwrap();
            let mut ring = AsyncRingReader::new(b_reader).unwrap();
            let mut out = Vec::new();
            for _ in 0..n {
                out.clear();
                tokio::time::timeout(WAIT, ring.recv(&mut out))
                    .await
                    .unwrap()
                    .unwrap();
                to_a.send(&out, soon()).unwrap();
            }
        });
    });
    runtime(true).block_on(async {
        let mut to_b = RingWriter::open(b_fds).unwrap();
        let mut ring = AsyncRingReader::new(a_reader).unwrap();
        let mut out = Vec::new();
        for i in 0..n {
            to_b.send(&frame(i, 215), soon()).unwrap();
            out.clear();
            tokio::time::timeout(WAIT, ring.recv(&mut out))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(out, frame(i, 215));
        }
    });
    echo.join().unwrap();
}

#[test]
fn an_async_reader_needs_a_runtime() {
    let (reader, _fds) = RingReader::create(MIN_CAPACITY, PollWindow::never()).unwrap();
    assert!(matches!(
        AsyncRingReader::new(reader),
        Err(RingError::Io(_))
    ));
}

// --- The poll window ---

#[test]
fn the_window_explores_keeps_and_halves() {
    let us = Duration::from_micros;
    let mut w = PollWindow::new(us(50));
    assert_eq!(w.current(), Duration::ZERO);
    w.observe(us(51));
    assert_eq!(
        w.current(),
        Duration::ZERO,
        "a gap over the max: no exploring"
    );
    w.observe(us(40));
    assert_eq!(
        w.current(),
        us(50),
        "a gap over half the max explores the max (a round trip whose other side sleeps)"
    );
    w.observe(us(40));
    assert_eq!(w.current(), us(50), "and catches the next one");
    for _ in 0..8 {
        w.observe(us(1000));
    }
    assert_eq!(w.current(), Duration::ZERO);
    w.observe(us(10));
    assert_eq!(w.current(), us(20), "explores twice the gap");
    w.observe(us(3));
    w.observe(us(20));
    assert_eq!(w.current(), us(20), "hits keep it");
    w.observe(us(21));
    assert_eq!(w.current(), us(10), "a miss halves it");
    for _ in 0..5 {
        w.observe(us(1000));
    }
    assert_eq!(w.current(), Duration::ZERO, "misses bring it to zero");
    w.observe(us(25));
    assert_eq!(w.current(), us(50), "at most the max");
}

/// On two or three CPUs a window explores only gaps up to half its max (a polling consumer
/// there holds a core its peer needs); on one it never polls.
#[test]
fn few_cpus_explore_only_short_gaps() {
    let us = Duration::from_micros;
    for cpus in [2, 3] {
        let mut w = PollWindow::with_cpus(cpus, us(50));
        w.observe(us(40));
        assert_eq!(
            w.current(),
            Duration::ZERO,
            "{cpus} CPUs: a gap over half the max"
        );
        w.observe(us(20));
        assert_eq!(w.current(), us(40), "{cpus} CPUs: a short gap explores");
    }
    let mut w = PollWindow::with_cpus(PollWindow::EXPLORE_ALL_CPUS, us(50));
    w.observe(us(40));
    assert_eq!(w.current(), us(50));
    let mut w = PollWindow::with_cpus(1, us(50));
    w.observe(us(1));
    assert_eq!(w.current(), Duration::ZERO);
}

proptest! {
    /// Whatever it sees: never above its max; `never` stays zero; a hit keeps it; a miss on
    /// a window at least halves it; from zero, exactly the gaps within the exploring limit
    /// explore (the max, or half of it on two or three CPUs).
    #[test]
    fn the_window_stays_in_bounds(
        max_us in 0u64..200,
        cpus in 2usize..8,
        gaps in prop::collection::vec(0u64..300_000, 1..200),
    ) {
        let max = Duration::from_micros(max_us);
        let mut w = PollWindow::with_cpus(cpus, max);
        let explore = if cpus < PollWindow::EXPLORE_ALL_CPUS { max / 2 } else { max };
        let mut never = PollWindow::never();
        for gap in gaps.into_iter().map(Duration::from_nanos) {
            let before = w.current();
            w.observe(gap);
            never.observe(gap);
            prop_assert!(w.current() <= max);
            prop_assert_eq!(never.current(), Duration::ZERO);
            if gap <= before {
                prop_assert_eq!(w.current(), before);
            } else if before.is_zero() {
                let explores = gap <= explore;
                prop_assert_eq!(
                    w.current(),
                    if explores { (gap * 2).min(max) } else { Duration::ZERO }
                );
            } else {
                prop_assert!(w.current() <= before / 2);
            }
        }
    }
}
