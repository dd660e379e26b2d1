//! This process's record of a decision until the watch shows it, and the
//! one place such a record is rolled back.

use gpuhealth_api::node_health::GpuNodeHealthStatus;

use crate::context::Context;

/// This process's record of its decision for a node, made under the
/// decisions lock so that every other node's budget counts it at once.
/// Unless [`Pending::keep`] says the decision is written, dropping it puts
/// back what was recorded before: the one place a record is rolled back.
pub struct Pending<'a> {
    ctx: &'a Context,
    node: String,
    before: Option<GpuNodeHealthStatus>,
    kept: bool,
}

impl<'a> Pending<'a> {
    pub fn new(ctx: &'a Context, node: &str, before: Option<GpuNodeHealthStatus>) -> Self {
        Pending {
            ctx,
            node: node.to_owned(),
            before,
            kept: false,
        }
    }

    /// The decision is in the cluster (its status, or its fence): it
    /// stays recorded whatever happens next.
    pub fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let mut records = self.ctx.lock_decisions();
        match self.before.take() {
            Some(before) => records.insert(self.node.clone(), before),
            None => records.remove(&self.node),
        };
    }
}
