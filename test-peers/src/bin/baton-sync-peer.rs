//! The helper process of `tests/versions.rs`: a sender of versioned syncs, started with
//! `Node::spawn_child`. From the version its receivers have (`--from`), it syncs one
//! version after another to every receiver of the parent (`versions.a`, `versions.b`), each
//! version in `--parts` bundles whose every element encodes the version and the part, one
//! part after another and one receiver after the other, until the parent kills it (the
//! test) or `--versions` are done.

#[path = "../../../tests/support/versions_msgs.rs"]
mod msgs;

use baton::actors::{Bundle, Node, SyncSender};
use baton::messages::{BundleLayout, DType, Shape};
use clap::Parser;
use msgs::*;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "Syncs versions to the parent's receivers until killed (tests/versions.rs)")]
struct Args {
    /// The version the receivers have (the first sync makes the next).
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Bundles per version.
    #[arg(long, default_value_t = 3)]
    parts: u32,
    /// Versions to sync before exiting (0: until killed).
    #[arg(long, default_value_t = 0)]
    versions: u64,
}

#[actix::main]
async fn main() {
    let args = Args::parse();
    let (node, parent) = match Node::join().await {
        Ok(joined) => joined,
        Err(e) => {
            eprintln!("baton-sync-peer: {e}");
            std::process::exit(1);
        }
    };
    let layout = BundleLayout::packed([("w", DType::U64, Shape::vector(ELEMENTS as u64))])
        .expect("a layout");
    let bundles: Vec<Bundle> = (0..args.parts)
        .map(|_| node.allocate_bundle(layout.clone()).expect("a bundle"))
        .collect();
    let receivers: Vec<_> = RECEIVERS
        .iter()
        .map(|name| parent.remote::<SyncPart>(name))
        .collect();
    let mut sender = SyncSender::new(args.from);
    let mut synced = 0;
    while args.versions == 0 || synced < args.versions {
        let version = sender
            .begin(args.parts, Instant::now() + Duration::from_secs(10))
            .expect("a feasible deadline");
        for (part, bundle) in (0..).zip(&bundles) {
            bundle
                .write("w", &vec![value(version, part); ELEMENTS])
                .expect("the bundle is ours again");
        }
        // One part after another, to one receiver after the other, as a trainer streams
        // its shards: a kill lands between any two of them.
        for (part, bundle) in (0..).zip(&bundles) {
            let stamp = sender.stamp(part).expect("within the deadline");
            for to in &receivers {
                let answer = to
                    .send(SyncPart {
                        part: bundle.share_stamped(stamp),
                    })
                    .await;
                match answer {
                    Ok(Ok(_)) => {}
                    // A receiver ahead (it had this version from the sender killed before).
                    Ok(Err(refused)) if refused.contains("stale") => {}
                    other => {
                        eprintln!("baton-sync-peer: version {version}: {other:?}");
                        std::process::exit(2);
                    }
                }
            }
        }
        sender.finish().expect("every part sent in time");
        for bundle in &bundles {
            bundle.buffer().returned().await;
        }
        synced += 1;
    }
    parent.close_and_wait().await;
}
