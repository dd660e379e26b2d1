//! Field checks shared by the annotation values. Each returns the reason a
//! value is refused; the caller names the field.

use super::ContractError;

pub(super) fn invalid(
    annotation: &'static str,
    field: impl Into<String>,
    reason: impl Into<String>,
) -> ContractError {
    ContractError::Invalid {
        annotation,
        field: field.into(),
        reason: reason.into(),
    }
}

/// A shortened, printable copy of untrusted text for an error message.
pub(super) fn excerpt(s: &str) -> String {
    let mut out: String = s.chars().take(64).filter(|c| !c.is_control()).collect();
    if s.chars().count() > 64 {
        out.push('…');
    }
    out
}

pub(super) fn bounded_text(s: &str, max: usize) -> Result<(), String> {
    if s.len() > max {
        return Err(format!("longer than {max} bytes"));
    }
    Ok(())
}

pub(super) fn non_empty_text(s: &str, max: usize) -> Result<(), String> {
    if s.trim().is_empty() {
        return Err("must not be empty".into());
    }
    bounded_text(s, max)
}

/// A DNS-1123 label: a namespace name.
pub(super) fn dns_label(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!("{:?} is not a DNS label", excerpt(s)))
    }
}

/// A DNS-1123 subdomain: a pod name.
pub(super) fn dns_subdomain(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!("{:?} is not a DNS subdomain", excerpt(s)))
    }
}

/// A GPU or MIG UUID as NVML prints it: `GPU-` then hex groups.
/// A request's `gpus`: 1 to 64 GPU UUIDs, never indexes.
pub(super) fn gpu_uuids(annotation: &'static str, gpus: &[String]) -> Result<(), ContractError> {
    if gpus.is_empty() || gpus.len() > 64 {
        return Err(invalid(
            annotation,
            "gpus",
            "must list between 1 and 64 GPU UUIDs",
        ));
    }
    for (i, uuid) in gpus.iter().enumerate() {
        gpu_uuid(uuid).map_err(|r| invalid(annotation, format!("gpus[{i}]"), r))?;
    }
    Ok(())
}

pub(super) fn gpu_uuid(s: &str) -> Result<(), String> {
    let body = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("MIG-"));
    let ok = match body {
        Some(b) => {
            b.len() >= 8
                && b.len() <= 64
                && b.bytes().all(|c| c.is_ascii_hexdigit() || c == b'-')
                && b.bytes().any(|c| c.is_ascii_hexdigit())
        }
        None => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a GPU UUID (GPU-xxxxxxxx-...)",
            excerpt(s)
        ))
    }
}

/// A PCI bus id: `DDDD:BB:DD.F` with a 4- or 8-digit domain, as the kernel
/// log and `nvidia-smi` print it (the function digit optional).
pub(super) fn pci_bus_id(s: &str) -> Result<(), String> {
    let hex = |p: &str, lens: &[usize]| {
        lens.contains(&p.len()) && p.bytes().all(|c| c.is_ascii_hexdigit())
    };
    let (addr, func) = match s.split_once('.') {
        Some((a, f)) => (a, Some(f)),
        None => (s, None),
    };
    let parts: Vec<&str> = addr.split(':').collect();
    let ok = parts.len() == 3
        && hex(parts[0], &[4, 8])
        && hex(parts[1], &[2])
        && hex(parts[2], &[2])
        && func.is_none_or(|f| f.len() == 1 && matches!(f.as_bytes()[0], b'0'..=b'7'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a PCI bus id (0000:e1:00.0)",
            excerpt(s)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids() {
        for good in ["0000:e1:00.0", "00000000:E1:00.0", "0000:e1:00"] {
            assert!(pci_bus_id(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "e1:00.0",
            "0000:e1:00.8",
            "0000:zz:00.0",
            "0000:e1:00.0.0",
            "000:e1:00.0",
        ] {
            assert!(pci_bus_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn uuids() {
        assert!(gpu_uuid("GPU-5f2b1c3e-8a4d-4e6f-9b0a-1c2d3e4f5a6b").is_ok());
        assert!(gpu_uuid("MIG-5f2b1c3e-8a4d-4e6f-9b0a-1c2d3e4f5a6b").is_ok());
        for bad in ["", "GPU-", "5f2b1c3e-8a4d", "GPU-xyz12345", "GPU-' OR 1=1"] {
            assert!(gpu_uuid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names() {
        assert!(dns_label("ml-serving").is_ok());
        assert!(dns_label("ML").is_err());
        assert!(dns_label(&"a".repeat(64)).is_err());
        assert!(dns_subdomain("vllm-7d9f8-abcde").is_ok());
        assert!(dns_subdomain("a..b").is_err());
    }
}
