//! What the API server showed just after this replica took over. Its
//! cache may not yet show the last writes of the leader before it, so a
//! remediation starting in its first minute is confirmed against a list:
//! one list a term, in pages, shared by every start of that minute (each
//! start listing for itself took a list of every record per start, about
//! 8 MB each at 5,000 nodes). Only records that are not `Healthy` are
//! kept: the others count for nothing a start could exceed.

use std::{collections::HashMap, sync::Arc, time::Instant};

use gpuhealth_api::{GpuNodeHealth, node_health::Phase};
use gpuhealth_engine::machine::is_disruptive;
use kube::{Api, Client, api::ListParams};

/// Records listed a page at a time.
const PAGE: u32 = 500;

#[derive(Default)]
pub struct AtTakeover(tokio::sync::Mutex<Option<Listed>>);

struct Listed {
    /// The term it was listed in (when the term began).
    term: Instant,
    records: Arc<Vec<Arc<GpuNodeHealth>>>,
}

impl AtTakeover {
    /// The records not `Healthy`, as listed once in the term that began at
    /// `term`: the first caller lists, the others wait for its list.
    pub async fn records(
        &self,
        client: &Client,
        term: Instant,
    ) -> Result<Arc<Vec<Arc<GpuNodeHealth>>>, kube::Error> {
        let mut listed = self.0.lock().await;
        if let Some(l) = listed.as_ref().filter(|l| l.term == term) {
            return Ok(l.records.clone());
        }
        let records = Arc::new(not_healthy(client).await?);
        *listed = Some(Listed {
            term,
            records: records.clone(),
        });
        Ok(records)
    }
}

async fn not_healthy(client: &Client) -> Result<Vec<Arc<GpuNodeHealth>>, kube::Error> {
    let api: Api<GpuNodeHealth> = Api::all(client.clone());
    let mut params = ListParams::default().limit(PAGE);
    let mut kept = Vec::new();
    loop {
        let page = api.list(&params).await?;
        kept.extend(
            page.items
                .into_iter()
                .filter(|g| g.status.as_ref().is_some_and(|s| s.phase != Phase::Healthy))
                .map(Arc::new),
        );
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(kept),
        }
    }
}

/// The cache's records, each replaced by the listed one unless the cache's
/// is the one under way, and the listed ones the cache lacks: a start
/// counts what either shows (the cache may lag the leader before; the
/// list, this replica's own writes since).
pub fn merged(
    cache: &[Arc<GpuNodeHealth>],
    listed: &[Arc<GpuNodeHealth>],
) -> Vec<Arc<GpuNodeHealth>> {
    let disruptive = |g: &GpuNodeHealth| g.status.as_ref().is_some_and(|s| is_disruptive(s.phase));
    let mut by_name: HashMap<&str, &Arc<GpuNodeHealth>> = cache
        .iter()
        .filter_map(|g| Some((g.metadata.name.as_deref()?, g)))
        .collect();
    for g in listed {
        let Some(name) = g.metadata.name.as_deref() else {
            continue;
        };
        let keep_cached = by_name
            .get(name)
            .is_some_and(|c| disruptive(c) && !disruptive(g));
        if !keep_cached {
            by_name.insert(name, g);
        }
    }
    by_name.into_values().cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, phase: Phase) -> Arc<GpuNodeHealth> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "gpuhealth.io/v1alpha1",
                "kind": "GpuNodeHealth",
                "metadata": {"name": name},
                "spec": {},
                "status": {"phase": phase},
            }))
            .expect("record"),
        )
    }

    fn phases(records: &[Arc<GpuNodeHealth>]) -> Vec<(String, Phase)> {
        let mut out: Vec<(String, Phase)> = records
            .iter()
            .map(|g| {
                let phase = g.status.as_ref().map(|s| s.phase).unwrap_or_default();
                (g.metadata.name.clone().unwrap_or_default(), phase)
            })
            .collect();
        out.sort_by(|x, y| x.0.cmp(&y.0));
        out
    }

    #[test]
    fn a_start_counts_what_either_the_cache_or_the_list_shows_under_way() {
        // a: this replica's own start, in its cache, listed before it;
        // b: the predecessor's start, which the cache has not seen yet;
        // c: only in the list; d: only in the cache.
        let cache = [
            record("a", Phase::Draining),
            record("b", Phase::Healthy),
            record("d", Phase::Healthy),
        ];
        let listed = [
            record("a", Phase::Suspect),
            record("b", Phase::Quarantined),
            record("c", Phase::Failed),
        ];
        assert_eq!(
            phases(&merged(&cache, &listed)),
            [
                ("a".into(), Phase::Draining),
                ("b".into(), Phase::Quarantined),
                ("c".into(), Phase::Failed),
                ("d".into(), Phase::Healthy),
            ]
        );
    }
}
