//! The operator's seal on its records: a keyed hash (HMAC-SHA256) over what
//! a record says is under way, which only a holder of the key can make.
//! Admission lets only the operator write records; the seal is what the
//! operator itself checks before it carries on what a record says
//! (`gpuhealth_engine::machine::RecordSeal`), so that a record written while
//! admission was not in force (or with the protection check skipped) is
//! never laundered into a request.
//!
//! The key is 32 random bytes in a Secret of the operator's namespace,
//! made by the first leader that finds none, read by every leader after.

use std::time::Duration;

use gpuhealth_api::node_health::GpuNodeHealthStatus;
use gpuhealth_engine::machine::{RecordSeal, in_flight};
use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
};
use ring::{
    hmac,
    rand::{SecureRandom, SystemRandom},
};
use serde_json::json;
use tracing::{info, warn};

/// The Secret's key holding the seal's key.
const KEY: &str = "key";

/// How long to wait between tries to read or make the key at start.
const RETRY: Duration = Duration::from_secs(5);

pub struct Seal {
    key: hmac::Key,
}

impl Seal {
    pub fn from_key(bytes: &[u8]) -> Seal {
        Seal {
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
        }
    }

    /// Reads the key from Secret `name` in `namespace`, making it first if
    /// there is none; tries until it can, saying why it cannot.
    pub async fn load(client: &Client, namespace: &str, name: &str) -> Seal {
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        loop {
            match key(&api, name).await {
                Ok(bytes) => return Seal::from_key(&bytes),
                Err(e) => {
                    warn!(secret = %format!("{namespace}/{name}"), error = %e, "reading or making the key of the operator's seal; trying again")
                }
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// The seal for `status`, the record of `node`; none while nothing is
    /// under way.
    pub fn of(&self, node: &str, status: &GpuNodeHealthStatus) -> Option<String> {
        in_flight(status).then(|| {
            let tag = hmac::sign(&self.key, &sealed(node, status));
            tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
        })
    }

    /// What `status`, the record of `node`, carries of the seal.
    pub fn check(&self, node: &str, status: &GpuNodeHealthStatus) -> RecordSeal {
        let Some(seal) = &status.seal else {
            return RecordSeal::Absent;
        };
        let tag: Option<Vec<u8>> = (seal.len() % 2 == 0)
            .then(|| {
                (0..seal.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(seal.get(i..i + 2)?, 16).ok())
                    .collect()
            })
            .flatten();
        match tag {
            Some(tag) if hmac::verify(&self.key, &sealed(node, status), &tag).is_ok() => {
                RecordSeal::Verified
            }
            _ => RecordSeal::Broken,
        }
    }
}

/// What the seal covers: the node's name and what its record says is
/// under way, in one fixed serialisation.
fn sealed(node: &str, s: &GpuNodeHealthStatus) -> Vec<u8> {
    json!({
        "node": node,
        "phase": s.phase,
        "incident": s.incident,
        "action": s.action,
        "quarantine": s.quarantine,
        "bootIdBeforeReboot": s.boot_id_before_reboot,
        "maintenance": s.maintenance,
    })
    .to_string()
    .into_bytes()
}

/// The key in Secret `name`, made if there is none (two replicas making
/// it at once: the second reads the first's).
async fn key(api: &Api<Secret>, name: &str) -> Result<Vec<u8>, String> {
    for _ in 0..2 {
        if let Some(secret) = api.get_opt(name).await.map_err(|e| e.to_string())? {
            return secret
                .data
                .and_then(|mut d| d.remove(KEY))
                .map(|b| b.0)
                .filter(|b| b.len() >= 32)
                .ok_or_else(|| format!("it holds no key of 32 bytes or more under {KEY:?}"));
        }
        let mut bytes = vec![0u8; 32];
        SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| "no random bytes from the system".to_owned())?;
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_owned(),
                        "gpuhealth".to_owned(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            data: Some([(KEY.to_owned(), ByteString(bytes.clone()))].into()),
            ..Default::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(_) => {
                info!(secret = name, "made the key of the operator's seal");
                return Ok(bytes);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Err("made by someone else and gone again".into())
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{
        RecoveryAction,
        contract::RequestId,
        node_health::{ActionStatus, Phase},
    };
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

    use super::*;

    fn in_flight_reset() -> GpuNodeHealthStatus {
        let incident = "inc-1780000000-0123456789ab".to_owned();
        GpuNodeHealthStatus {
            phase: Phase::Remediating,
            action: Some(ActionStatus {
                id: RequestId::for_attempt(&incident, RecoveryAction::GpuReset, 1),
                type_: RecoveryAction::GpuReset,
                attempt: 1,
                gpus: vec!["GPU-0a1b2c3d-0000-4000-8000-000000000007".into()],
                started_at: Time(Timestamp::UNIX_EPOCH),
                requested_at: Some(Time(Timestamp::UNIX_EPOCH)),
                deadline: None,
            }),
            incident: Some(incident),
            ..Default::default()
        }
    }

    #[test]
    fn only_the_key_makes_a_seal_that_checks() {
        let seal = Seal::from_key(&[7; 32]);
        let mut status = in_flight_reset();
        assert_eq!(seal.check("n1", &status), RecordSeal::Absent);
        status.seal = seal.of("n1", &status);
        assert_eq!(seal.check("n1", &status), RecordSeal::Verified);
        // Through the API server and back: the same.
        let again: GpuNodeHealthStatus =
            serde_json::from_str(&serde_json::to_string(&status).expect("json")).expect("json");
        assert_eq!(seal.check("n1", &again), RecordSeal::Verified);
        // Another key, another node, or anything under way changed: not
        // the operator's.
        assert_eq!(
            Seal::from_key(&[8; 32]).check("n1", &status),
            RecordSeal::Broken
        );
        assert_eq!(seal.check("n2", &status), RecordSeal::Broken);
        let mut reboot = status.clone();
        if let Some(a) = reboot.action.as_mut() {
            a.type_ = RecoveryAction::NodeReboot;
        }
        assert_eq!(seal.check("n1", &reboot), RecordSeal::Broken);
        let mut later = status.clone();
        if let Some(a) = later.action.as_mut() {
            a.deadline = Some(Time(Timestamp::UNIX_EPOCH));
        }
        assert_eq!(seal.check("n1", &later), RecordSeal::Broken);
        for garbage in ["", "zz", "abc"] {
            status.seal = Some(garbage.into());
            assert_eq!(seal.check("n1", &status), RecordSeal::Broken, "{garbage:?}");
        }
        // Nothing under way: nothing to seal.
        assert_eq!(seal.of("n1", &GpuNodeHealthStatus::default()), None);
    }
}
