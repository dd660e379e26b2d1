//! gpuhealth's engine: pure decisions, no Kubernetes client. Inputs in
//! (time, policy, observed node, GPU report, pods, budgets, stored state),
//! decisions out (next state, actions).
//!
//! Empty for now: the remediation state machine, Xid classification and the
//! drain planner arrive with the remediation work (see the README's roadmap).
