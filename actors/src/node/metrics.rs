//! [`Node::publish_metrics`]: a node's status as metrics (see [`metrics`](crate::metrics)).

use super::Node;
use crate::metrics::{MetricsPublisher, record};
use baton_messages::status::MAX_STATUS_ENTRIES;
use std::time::Duration;

impl Node {
    /// Records this node's counters and gauges (see [`metrics`](crate::metrics)) now and
    /// every `every` after, until the returned guard drops. Must be called inside an
    /// actix system.
    pub fn publish_metrics(&self, every: Duration) -> MetricsPublisher {
        let node = self.clone();
        let task = actix::spawn(async move {
            loop {
                record(&node.status(MAX_STATUS_ENTRIES));
                tokio::time::sleep(every).await;
            }
        });
        MetricsPublisher::new(task)
    }
}
