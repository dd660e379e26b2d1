//! Why an incident took what it took out of service: `status.quarantine.why`.

use super::words;

words! {
    /// Why a quarantine is as wide as it is.
    pub enum QuarantineWhy {
        /// The policy's `quarantine.scope` is `Node`.
        PolicyScopeNode,
        /// The step takes the whole node down (a reboot, a replacement).
        StepTakesTheNode,
        /// What is wrong is not one GPU's (a node condition, a maintenance).
        NotOneGpu,
        /// Who holds a bad GPU is not known, so the drain would take every
        /// GPU pod anyway (`Auto` only).
        HoldersUnknown,
        /// The policy's drain takes more pods than the GPUs' holders (`Auto` only).
        DrainTakesMore,
        /// No device-level fence holds for a bad GPU: no DRA device names
        /// it, and the device plugin has not withdrawn exactly the bad GPUs.
        NoDeviceFence,
        /// The device plugin offered a bad GPU again.
        DevicePluginOffersBadGpu,
        /// Each bad GPU is fenced: a `DeviceTaintRule` or the device plugin
        /// keeps new work off it.
        GpusFenced,
    }
}
