//! [`Node::register_raw`]: untyped handlers (see [`raw`](crate::raw)).

use super::Node;
use crate::raw::{RawHandler, RawRegistered};
use std::sync::Arc;

impl Node {
    /// Makes `handler` reachable from other processes as `name`, for calls whose wire type
    /// name is `type_name` (a call of another type is refused with
    /// [`CallFault::WrongType`] before the handler sees it). As with
    /// [`Node::register`], one name serves several types: this replaces only an earlier
    /// registration of `name` for `type_name`, typed or raw. See the
    /// [module docs](crate::raw).
    ///
    /// [`CallFault::WrongType`]: baton_messages::protocol::CallFault::WrongType
    pub fn register_raw(&self, name: &str, type_name: &str, handler: impl RawHandler) {
        self.core
            .insert_handler(name, Arc::new(RawRegistered::new(type_name, handler)));
    }
}
