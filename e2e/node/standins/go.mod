module gpuhealth.local/e2e/node/standins

go 1.26.0

require (
	github.com/opencontainers/runtime-spec v1.3.0
	google.golang.org/grpc v1.79.3
	k8s.io/kubelet v0.36.3
	tags.cncf.io/container-device-interface v1.1.2
)

require (
	github.com/fsnotify/fsnotify v1.7.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.49.0 // indirect
	golang.org/x/sys v0.40.0 // indirect
	golang.org/x/text v0.33.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260128011058-8636f8732409 // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.1 // indirect
)
