//! A DRA device named as a claim's allocation names it: its driver, its
//! pool and its name, written `driver/pool/device` in status and logs.
//! A pool's name may itself hold slashes (DNS subdomains separated by
//! `/`); a driver's and a device's never do, which is how the written
//! form is read back.

use std::{fmt, str::FromStr};

use crate::string_form::string_form;

/// What [`DeviceId::from_str`] reads: a driver and a device without a
/// slash, a pool between them.
pub const PATTERN: &str = "^[^/]+/.+/[^/]+$";

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub driver: String,
    pub pool: String,
    pub device: String,
}

impl DeviceId {
    pub fn new(
        driver: impl Into<String>,
        pool: impl Into<String>,
        device: impl Into<String>,
    ) -> Self {
        DeviceId {
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.driver, self.pool, self.device)
    }
}

impl FromStr for DeviceId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts = s
            .split_once('/')
            .and_then(|(driver, rest)| Some((driver, rest.rsplit_once('/')?)));
        match parts {
            Some((driver, (pool, device)))
                if !driver.is_empty() && !pool.is_empty() && !device.is_empty() =>
            {
                Ok(DeviceId::new(driver, pool, device))
            }
            _ => Err(format!("{s:?} is not driver/pool/device")),
        }
    }
}

string_form!(DeviceId, "DeviceId", {
    "type": "string",
    "description": "A DRA device, as `driver/pool/device`.",
    "pattern": PATTERN,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_id_is_written_and_read_as_driver_pool_device() {
        let id = DeviceId::new("gpu.nvidia.com", "node-a", "gpu-7");
        assert_eq!(id.to_string(), "gpu.nvidia.com/node-a/gpu-7");
        assert_eq!("gpu.nvidia.com/node-a/gpu-7".parse(), Ok(id.clone()));
        let json = serde_json::to_value(&id).expect("serialises");
        assert_eq!(json, serde_json::json!("gpu.nvidia.com/node-a/gpu-7"));
        assert_eq!(serde_json::from_value::<DeviceId>(json).ok(), Some(id));
        // A pool of several subdomains keeps its slashes.
        let deep = DeviceId::new("gpu.nvidia.com", "rack-1/node-a", "gpu-0");
        assert_eq!(deep.to_string().parse(), Ok(deep));
        for bad in ["gpu-0", "d/gpu-0", "/p/gpu-0", "d//gpu-0", "d/p/"] {
            assert!(bad.parse::<DeviceId>().is_err(), "{bad}");
        }
    }
}
