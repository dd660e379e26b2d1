//! Figures: a process's memory and CPU from /proc, API requests from its
//! `/metrics`, and percentiles.

use std::collections::BTreeMap;

use serde::Serialize;

/// `VmRSS` and `VmHWM` (the peak) of `pid`, in KiB.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// User plus system CPU time of `pid`, in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux the kernel ABI allows.
    Some(ticks as f64 / 100.0)
}

/// API requests by verb and resource, summed over codes, from the
/// `family` counter (`gpuhealth_api_requests_total`) in `exposition`.
pub fn requests(exposition: &str, family: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(family).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry((label("verb"), label("resource"))).or_insert(0.0) += value;
    }
    out
}

/// Requests between two scrapes, by verb.
pub fn by_verb(
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
    include: impl Fn(&str, &str) -> bool,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for ((verb, resource), n) in after {
        if !include(verb, resource) {
            continue;
        }
        let was = before
            .get(&(verb.clone(), resource.clone()))
            .copied()
            .unwrap_or(0.0);
        if n - was > 0.0 {
            *out.entry(verb.clone()).or_insert(0.0) += n - was;
        }
    }
    out
}

pub const WRITES: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// Percentiles of a sample, in the sample's unit.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Distribution {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub min: f64,
}

impl Distribution {
    pub fn of(mut sample: Vec<f64>) -> Distribution {
        sample.sort_by(f64::total_cmp);
        let at = |q: f64| -> f64 {
            if sample.is_empty() {
                return 0.0;
            }
            // Nearest rank.
            let rank = ((q * sample.len() as f64).ceil() as usize).clamp(1, sample.len());
            sample[rank - 1]
        };
        Distribution {
            n: sample.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: sample.last().copied().unwrap_or(0.0),
            min: sample.first().copied().unwrap_or(0.0),
        }
    }
}

pub fn median(sample: &[f64]) -> f64 {
    Distribution::of(sample.to_vec()).p50
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let d = Distribution::of((1..=100).map(f64::from).collect());
        assert_eq!(
            (d.p50, d.p99, d.max, d.min, d.n),
            (50.0, 99.0, 100.0, 1.0, 100)
        );
        let one = Distribution::of(vec![7.0]);
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
    }

    #[test]
    fn requests_are_summed_over_codes_and_split_by_verb() {
        let before = requests(
            "gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"200\"} 2\n",
            "gpuhealth_api_requests_total",
        );
        let after = requests(
            "# TYPE gpuhealth_api_requests counter\n\
             gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"200\"} 5\n\
             gpuhealth_api_requests_total{verb=\"patch\",resource=\"nodes\",code=\"409\"} 1\n\
             gpuhealth_api_requests_total{verb=\"update\",resource=\"leases\",code=\"200\"} 9\n",
            "gpuhealth_api_requests_total",
        );
        let all = by_verb(&before, &after, |_, _| true);
        assert_eq!(all.get("patch"), Some(&4.0));
        assert_eq!(all.get("update"), Some(&9.0));
        let no_lease = by_verb(&before, &after, |_, r| r != "leases");
        assert_eq!(no_lease.get("update"), None);
    }
}
