//! A pod named by namespace and name: written `namespace/name` in status
//! and logs, and never split back by anyone else.

use std::{fmt, str::FromStr};

use crate::string_form::string_form;

/// What [`PodKey::from_str`] reads: two names and one slash.
pub const PATTERN: &str = "^[^/]+/[^/]+$";

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

impl PodKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        PodKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A key equals its written form, `namespace/name`.
impl PartialEq<str> for PodKey {
    fn eq(&self, other: &str) -> bool {
        other
            .split_once('/')
            .is_some_and(|(ns, name)| ns == self.namespace && name == self.name)
    }
}

impl PartialEq<&str> for PodKey {
    fn eq(&self, other: &&str) -> bool {
        self == *other
    }
}

impl PartialEq<String> for PodKey {
    fn eq(&self, other: &String) -> bool {
        self == other.as_str()
    }
}

impl FromStr for PodKey {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(PodKey::new(ns, name))
            }
            _ => Err(format!("{s:?} is not namespace/name")),
        }
    }
}

string_form!(PodKey, "PodKey", {
    "type": "string",
    "description": "A pod, as `namespace/name`.",
    "pattern": PATTERN,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_key_is_written_and_read_as_namespace_slash_name() {
        let key = PodKey::new("ml", "vllm-0");
        assert_eq!(key.to_string(), "ml/vllm-0");
        assert_eq!("ml/vllm-0".parse(), Ok(key.clone()));
        assert_eq!(key, "ml/vllm-0");
        assert_ne!(key, "ml/vllm-1");
        let json = serde_json::to_value(&key).expect("serialises");
        assert_eq!(json, serde_json::json!("ml/vllm-0"));
        for bad in ["vllm-0", "/vllm-0", "ml/", "a/b/c"] {
            assert!(bad.parse::<PodKey>().is_err(), "{bad}");
        }
    }
}
