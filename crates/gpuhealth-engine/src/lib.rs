//! gpuhealth's engine: pure decisions, no Kubernetes client. Inputs in
//! (time, policy, observed node, GPU report, pods, budgets, stored state),
//! decisions out (next state, actions).

pub mod budget;
pub mod diagnosis;
pub mod drain;
pub mod fence;
pub mod gangs;
pub mod guardrails;
pub mod happening;
pub mod honour;
pub mod machine;
pub mod others;
pub mod probes;
pub mod problem;
pub mod restarts;
pub mod windows;
pub mod workload;
pub mod xid;
