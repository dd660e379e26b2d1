//! Faults during a policy change's pass: each comes `--pass-fault-delay-ms`
//! after a change of the policy's spec, while the operator looks at every
//! node of the fleet again, one fault per change. Its time to quarantine
//! is judged against the floor's in the same fleet, which has no pass.

use std::time::{Duration, Instant};

use gpuhealth_api::GpuHealthPolicy;
use kube::{Api, Client};
use serde_json::json;

use crate::{
    Args, Result,
    fleet::{self, recovered},
    policy::set_policy,
    results::DuringPass,
    say, stats,
    watch::{self, Cordons},
};

pub async fn measure(
    args: &Args,
    client: &Client,
    cordons: &Cordons,
    nodes: &[String],
) -> Result<DuringPass> {
    say(&format!(
        "faults during a policy change's pass: {} faults, each {} ms after a change",
        nodes.len(),
        args.pass_fault_delay_ms
    ));
    let policies: Api<GpuHealthPolicy> = Api::all(client.clone());
    let change =
        |max_concurrent: &str| set_policy(&policies, json!({"maxConcurrent": max_concurrent}));
    let mut seconds = Vec::new();
    let mut missed: Vec<&String> = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        // A new generation each time: every node is looked at again.
        change(if i % 2 == 0 { "99%" } else { "100%" }).await?;
        tokio::time::sleep(Duration::from_millis(args.pass_fault_delay_ms)).await;
        let at = Instant::now();
        fleet::break_gpu(client, node).await?;
        let deadline = Instant::now() + Duration::from_secs(120);
        match watch::awaited(deadline, || cordons.quarantine(node, at)).await {
            Some((sick, cordoned)) => seconds.push(cordoned.duration_since(sick).as_secs_f64()),
            None => missed.push(node),
        }
    }
    change("100%").await?;
    if !missed.is_empty() {
        say(&format!(
            "{} faults during a pass never seen cordoned: {missed:?}",
            missed.len()
        ));
        return Err("gpuhealth did not cordon every node that failed during a pass".into());
    }
    recovered(client, nodes).await?;
    Ok(DuringPass {
        delay_ms: args.pass_fault_delay_ms,
        gpuhealth: stats::Distribution::of(seconds.clone()),
        seconds,
    })
}
