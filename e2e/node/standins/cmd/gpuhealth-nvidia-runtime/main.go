// gpuhealth-nvidia-runtime stands in for the NVIDIA Container Runtime in
// its CDI mode, as the `nvidia` RuntimeClass's handler on the real e2e
// node: containerd runs it where it would run runc. On `create` it reads
// the container's NVIDIA_VISIBLE_DEVICES (`all`, or GPU indexes or UUIDs;
// unset, empty, `void` or `none`: nothing), injects the matching
// `nvidia.com/gpu` CDI devices into the bundle's config.json with the real
// CDI library (their device nodes, and the spec's shared edits: NVML,
// nvidia-smi, nvidia-persistenced's socket), and hands over to runc. As
// the real runtime in CDI mode, it leaves NVIDIA_DRIVER_CAPABILITIES alone.
// Every other command goes to runc as it is.
//
// The stand-in's GPUs are files, not device nodes, so it also plays the
// kernel's part for a privileged container, which sees the host's devices:
// it gets each of the stand-in's `nvidia*` files at /dev/<name>, as it
// would get NVIDIA's device nodes (the node's default handler is this
// program too, for that alone).
//
// Settings come from the environment, which each handler's wrapper sets:
// GPUHEALTH_CDI_DIRS (colon-separated; unset: no CDI injection),
// GPUHEALTH_HOST_GPU_DEVICES (the stand-in's device files) and
// GPUHEALTH_RUNC.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

const kind = "nvidia.com/gpu"

func main() {
	runc := os.Getenv("GPUHEALTH_RUNC")
	if runc == "" {
		runc = "runc"
	}
	args := os.Args[1:]
	if bundle, creating := bundleOf(args); creating {
		if err := inject(bundle); err != nil {
			fmt.Fprintf(os.Stderr, "nvidia runtime: %v\n", err)
			os.Exit(1)
		}
	}
	path := runc
	if !strings.Contains(runc, "/") {
		if p, err := lookPath(runc); err == nil {
			path = p
		}
	}
	err := syscall.Exec(path, append([]string{"runc"}, args...), os.Environ())
	fmt.Fprintf(os.Stderr, "nvidia runtime: running %s: %v\n", path, err)
	os.Exit(1)
}

// bundleOf finds the `create` command and its bundle (`--bundle`, `-b`,
// or the working directory) among runc's arguments.
func bundleOf(args []string) (string, bool) {
	creating := false
	bundle := ""
	for i, a := range args {
		switch {
		case a == "create":
			creating = true
		case (a == "--bundle" || a == "-b") && i+1 < len(args):
			bundle = args[i+1]
		case strings.HasPrefix(a, "--bundle="):
			bundle = strings.TrimPrefix(a, "--bundle=")
		}
	}
	if creating && bundle == "" {
		bundle, _ = os.Getwd()
	}
	return bundle, creating
}

func inject(bundle string) error {
	config := filepath.Join(bundle, "config.json")
	data, err := os.ReadFile(config)
	if err != nil {
		return err
	}
	var spec specs.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		return fmt.Errorf("%s: %w", config, err)
	}
	devices := requested(spec.Process)
	dirs := os.Getenv("GPUHEALTH_CDI_DIRS")
	changed := false
	if len(devices) > 0 && dirs != "" {
		cache, err := cdi.NewCache(cdi.WithSpecDirs(strings.Split(dirs, ":")...), cdi.WithAutoRefresh(false))
		if err != nil {
			return fmt.Errorf("the CDI specs: %w", err)
		}
		if unresolved, err := cache.InjectDevices(&spec, devices...); err != nil {
			return fmt.Errorf("injecting %v (unresolved %v): %w", devices, unresolved, err)
		}
		changed = true
	}
	if host := os.Getenv("GPUHEALTH_HOST_GPU_DEVICES"); host != "" && privileged(&spec) {
		if err := hostDevices(&spec, host); err != nil {
			return err
		}
		changed = true
	}
	if !changed {
		return nil
	}
	out, err := json.Marshal(&spec)
	if err != nil {
		return err
	}
	return os.WriteFile(config, out, 0o600)
}

// privileged says whether the container may open any device, as the CRI
// lets a privileged container (one rule allowing every device).
func privileged(spec *specs.Spec) bool {
	if spec.Linux == nil || spec.Linux.Resources == nil {
		return false
	}
	for _, rule := range spec.Linux.Resources.Devices {
		if rule.Allow && (rule.Type == "" || rule.Type == "a") && rule.Major == nil && rule.Minor == nil {
			return true
		}
	}
	return false
}

// hostDevices mounts each of dir's `nvidia*` files at /dev/<name>.
func hostDevices(spec *specs.Spec, dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("the stand-in's device files: %w", err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "nvidia") {
			continue
		}
		spec.Mounts = append(spec.Mounts, specs.Mount{
			Destination: "/dev/" + e.Name(),
			Type:        "bind",
			Source:      filepath.Join(dir, e.Name()),
			Options:     []string{"rbind", "rw", "nosuid"},
		})
	}
	return nil
}

// requested reads NVIDIA_VISIBLE_DEVICES as the toolkit does in CDI mode:
// each entry qualified with the default kind.
func requested(process *specs.Process) []string {
	if process == nil {
		return nil
	}
	value, found := "", false
	for _, e := range process.Env {
		if v, ok := strings.CutPrefix(e, "NVIDIA_VISIBLE_DEVICES="); ok {
			value, found = v, true
		}
	}
	if !found || value == "" || value == "void" || value == "none" {
		return nil
	}
	var devices []string
	for _, id := range strings.Split(value, ",") {
		if id = strings.TrimSpace(id); id != "" {
			devices = append(devices, kind+"="+id)
		}
	}
	return devices
}

func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, name)
		if info, err := os.Stat(p); err == nil && !info.IsDir() && info.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not on PATH", name)
}
