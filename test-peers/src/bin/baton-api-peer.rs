//! The helper process of `tests/api.rs`: a child started with `Node::spawn_child`. It
//! joins its parent with `Node::join`, registers the test actor under `api.*` names, and exits when
//! the link to its parent goes down (`Peer::closed`).

#[path = "../../../tests/support/api_msgs.rs"]
mod msgs;

use actix::prelude::*;
use baton::actors::{Lease, Node};
use msgs::*;
use std::time::Instant;

#[derive(Default)]
struct ApiActor {
    kept: Vec<Lease<u32>>,
    /// Leases held until revoked, by a number of ours.
    until_revoked: std::collections::HashMap<u64, Lease<u32>>,
    next: u64,
    revocations: Vec<u64>,
    node: Option<Node>,
}

impl Actor for ApiActor {
    type Context = Context<Self>;
}

impl Handler<SumInPlace> for ApiActor {
    type Result = Result<(f64, bool), String>;
    fn handle(&mut self, msg: SumInPlace, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        let slice = lease.as_slice().map_err(|e| e.to_string())?;
        let in_place = match lease.ptr().map_err(|e| e.to_string())? {
            baton::ipc::MemPtr::Host(p) => std::ptr::eq(p.cast_const(), slice.as_ptr().cast()),
            baton::ipc::MemPtr::Device(_) => false,
        };
        Ok((slice.iter().map(|&x| f64::from(x)).sum(), in_place))
    }
}

impl Handler<SumBundle> for ApiActor {
    type Result = Result<(Vec<f64>, u64), String>;
    fn handle(&mut self, msg: SumBundle, _: &mut Context<Self>) -> Self::Result {
        use baton::messages::DType;
        let lease = msg.weights.open().map_err(|e| e.to_string())?;
        let mut sums = Vec::with_capacity(lease.layout().len());
        for t in lease.layout().tensors() {
            let sum = match t.dtype {
                DType::F32 => lease
                    .tensor::<f32>(&t.name)
                    .map(|x| x.iter().map(|&v| f64::from(v)).sum()),
                DType::I64 => lease
                    .read::<i64>(&t.name)
                    .map(|x| x.iter().map(|&v| v as f64).sum()),
                other => return Err(format!("no test reads {other:?}")),
            };
            sums.push(sum.map_err(|e| e.to_string())?);
        }
        let opens = self.node.as_ref().map_or(0, |n| n.cache().stats().opens);
        Ok((sums, opens))
    }
}

impl Handler<Keep> for ApiActor {
    type Result = usize;
    fn handle(&mut self, msg: Keep, _: &mut Context<Self>) -> usize {
        self.kept.push(msg.data.open().expect("a received buffer"));
        self.kept.len()
    }
}

impl Handler<GiveBack> for ApiActor {
    type Result = usize;
    fn handle(&mut self, _: GiveBack, _: &mut Context<Self>) -> usize {
        self.kept.drain(..).count()
    }
}

impl Handler<KeepUntilRevoked> for ApiActor {
    type Result = ();
    fn handle(&mut self, msg: KeepUntilRevoked, ctx: &mut Context<Self>) {
        let lease = msg.data.open().expect("a received buffer");
        let key = self.next;
        self.next += 1;
        // The holder handles its own lease's revoke: no node-level subscription, no ids.
        ctx.spawn(
            lease
                .revoked()
                .into_actor(self)
                .map(move |deadline, act, _| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    act.revocations.push(left.as_millis() as u64);
                    act.until_revoked.remove(&key); // dropping it gives it back
                }),
        );
        self.until_revoked.insert(key, lease);
    }
}

impl Handler<KeepAllUntilRevoked> for ApiActor {
    type Result = ();
    fn handle(&mut self, msg: KeepAllUntilRevoked, ctx: &mut Context<Self>) {
        let leases: Vec<_> = (msg.data.into_iter())
            .map(|s| s.open().expect("a received buffer"))
            .collect();
        let Some(first) = leases.first() else { return };
        ctx.spawn(
            first
                .revoked()
                .into_actor(self)
                .map(move |deadline, act, _| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    act.revocations.push(left.as_millis() as u64);
                    drop(leases);
                }),
        );
    }
}

impl Handler<Revocations> for ApiActor {
    type Result = Vec<u64>;
    fn handle(&mut self, _: Revocations, _: &mut Context<Self>) -> Vec<u64> {
        self.revocations.clone()
    }
}

impl Handler<Fill> for ApiActor {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: Fill, _: &mut Context<Self>) -> Self::Result {
        let lease = msg.data.open().map_err(|e| e.to_string())?;
        lease
            .write_at(0, &vec![msg.value; lease.len()])
            .map_err(|e| e.to_string())
    }
}

impl Handler<WhichBackend> for ApiActor {
    type Result = MessageResult<WhichBackend>;
    fn handle(&mut self, _: WhichBackend, _: &mut Context<Self>) -> Self::Result {
        let backend = self.node.as_ref().expect("joined").backend();
        MessageResult((backend.name().to_owned(), format!("{:?}", backend.kind())))
    }
}

#[actix::main]
async fn main() {
    let (node, parent) = match Node::join().await {
        Ok(joined) => joined,
        Err(e) => {
            eprintln!("baton-api-peer: {e}");
            std::process::exit(1);
        }
    };
    let actor = ApiActor {
        node: Some(node.clone()),
        ..ApiActor::default()
    }
    .start();
    node.register::<SumInPlace>("api.sum", actor.clone().recipient());
    node.register::<Keep>("api.keep", actor.clone().recipient());
    node.register::<SumBundle>("api.bundle", actor.clone().recipient());
    node.register::<GiveBack>("api.give", actor.clone().recipient());
    node.register::<KeepUntilRevoked>("api.revocable", actor.clone().recipient());
    node.register::<KeepAllUntilRevoked>("api.revocable_all", actor.clone().recipient());
    node.register::<Revocations>("api.revocations", actor.clone().recipient());
    node.register::<Fill>("api.fill", actor.clone().recipient());
    node.register::<WhichBackend>("api.backend", actor.recipient());
    parent.closed().await;
}
