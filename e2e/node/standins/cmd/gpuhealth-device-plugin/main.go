// gpuhealth-device-plugin stands in for NVIDIA's device plugin on the
// real e2e node, on the kubelet's real device-plugin API (v1beta1), with
// the NVML stand-in's GPUs. As NVIDIA's does in its cdi-cri strategy, it
// writes a CDI spec of its own and answers Allocate with CDI device names
// (k8s.device-plugin.nvidia.com/gpu=<UUID>), so that containerd injects
// the GPU and the kubelet's PodResources name it by UUID. As NVIDIA's
// does, it holds every GPU while it runs (its NVML health checks do), marks
// a GPU unhealthy on a critical Xid and offers it again only when it
// starts afresh: the GPU Operator restarts it through its node label,
// which a reset pauses.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	resource = "nvidia.com/gpu"
	cdiKind  = "k8s.device-plugin.nvidia.com/gpu"
	socket   = "gpuhealth-nvidia-gpu.sock"
)

// Xids NVIDIA's plugin does not hold against a GPU: the application's own.
var applicationXids = map[int]bool{13: true, 31: true, 43: true, 45: true, 68: true, 109: true}

type gpu struct {
	index int
	uuid  string
	minor int
}

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	root string
	gpus []gpu

	mu        sync.Mutex
	unhealthy map[string]bool
	changed   chan struct{}
}

func main() {
	root := flag.String("root", "/var/lib/gpuhealth-standin", "the NVML stand-in's GPUs")
	pluginDir := flag.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "where to write this plugin's CDI spec")
	flag.Parse()
	log.SetPrefix("gpuhealth-device-plugin: ")

	gpus, err := readGpus(*root)
	if err != nil || len(gpus) == 0 {
		log.Fatalf("the stand-in's GPUs under %s: %v (%d found)", *root, err, len(gpus))
	}
	// What NVML's health checks hold while the plugin runs.
	for _, g := range gpus {
		if _, err := os.Open(devicePath(*root, g)); err != nil {
			log.Fatalf("holding GPU %d: %v", g.index, err)
		}
	}
	if err := writeSpec(*cdiDir, *root, gpus); err != nil {
		log.Fatalf("writing the CDI spec: %v", err)
	}
	p := &plugin{root: *root, gpus: gpus, unhealthy: map[string]bool{}, changed: make(chan struct{}, 1)}

	endpoint := filepath.Join(*pluginDir, socket)
	_ = os.Remove(endpoint)
	listener, err := net.Listen("unix", endpoint)
	if err != nil {
		log.Fatalf("listening on %s: %v", endpoint, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	if err := register(filepath.Join(*pluginDir, "kubelet.sock")); err != nil {
		log.Fatalf("registering with the kubelet: %v", err)
	}
	log.Printf("offering %d GPU(s) as %s", len(gpus), resource)
	go p.watchXids()

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	server.Stop()
	_ = os.Remove(endpoint)
}

func readGpus(root string) ([]gpu, error) {
	var gpus []gpu
	for i := 0; ; i++ {
		text, err := os.ReadFile(filepath.Join(root, "gpu", strconv.Itoa(i)))
		if os.IsNotExist(err) {
			return gpus, nil
		}
		if err != nil {
			return nil, err
		}
		g := gpu{index: i, minor: i}
		for _, line := range strings.Split(string(text), "\n") {
			key, value, _ := strings.Cut(line, "=")
			switch key {
			case "uuid":
				g.uuid = value
			case "minor":
				if m, err := strconv.Atoi(value); err == nil {
					g.minor = m
				}
			}
		}
		gpus = append(gpus, g)
	}
}

func devicePath(root string, g gpu) string {
	return filepath.Join(root, "dev", fmt.Sprintf("nvidia%d", g.minor))
}

// writeSpec writes the CDI spec of the GPUs it hands out: each GPU's
// device node (a file of the stand-in's, bind-mounted where the driver's
// would be).
func writeSpec(dir, root string, gpus []gpu) error {
	type mount struct {
		HostPath      string   `json:"hostPath"`
		ContainerPath string   `json:"containerPath"`
		Options       []string `json:"options"`
	}
	type device struct {
		Name           string `json:"name"`
		ContainerEdits struct {
			Mounts []mount `json:"mounts"`
		} `json:"containerEdits"`
	}
	spec := struct {
		CdiVersion string   `json:"cdiVersion"`
		Kind       string   `json:"kind"`
		Devices    []device `json:"devices"`
	}{CdiVersion: "0.6.0", Kind: cdiKind}
	for _, g := range gpus {
		d := device{Name: g.uuid}
		d.ContainerEdits.Mounts = []mount{{
			HostPath:      devicePath(root, g),
			ContainerPath: fmt.Sprintf("/dev/nvidia%d", g.minor),
			Options:       []string{"bind", "rw"},
		}}
		spec.Devices = append(spec.Devices, d)
	}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(dir, "k8s.device-plugin.nvidia.com-gpu.json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func register(kubelet string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socket,
		ResourceName: resource,
	})
	return err
}

// watchXids marks a GPU unhealthy on a critical Xid in the stand-in's
// events (`<index> <xid>` lines), from those written after it started.
func (p *plugin) watchXids() {
	path := filepath.Join(p.root, "events")
	var offset int64
	if info, err := os.Stat(path); err == nil {
		offset = info.Size()
	}
	for range time.Tick(200 * time.Millisecond) {
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		if _, err := f.Seek(offset, 0); err != nil {
			f.Close()
			continue
		}
		reader := bufio.NewReader(f)
		for {
			line, err := reader.ReadString('\n')
			if err != nil {
				break
			}
			offset += int64(len(line))
			var index, xid int
			if _, err := fmt.Sscanf(line, "%d %d", &index, &xid); err != nil || applicationXids[xid] {
				continue
			}
			if index >= 0 && index < len(p.gpus) {
				p.mu.Lock()
				p.unhealthy[p.gpus[index].uuid] = true
				p.mu.Unlock()
				log.Printf("Xid %d on GPU %d: marked unhealthy until this plugin restarts", xid, index)
				select {
				case p.changed <- struct{}{}:
				default:
				}
			}
		}
		f.Close()
	}
}

func (p *plugin) devices() []*pluginapi.Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*pluginapi.Device
	for _, g := range p.gpus {
		health := pluginapi.Healthy
		if p.unhealthy[g.uuid] {
			health = pluginapi.Unhealthy
		}
		out = append(out, &pluginapi.Device{ID: g.uuid, Health: health})
	}
	return out
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	for {
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices()}); err != nil {
			return err
		}
		select {
		case <-p.changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		r := &pluginapi.ContainerAllocateResponse{}
		for _, id := range c.DevicesIds {
			r.CdiDevices = append(r.CdiDevices, &pluginapi.CDIDevice{Name: cdiKind + "=" + id})
		}
		response.ContainerResponses = append(response.ContainerResponses, r)
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
