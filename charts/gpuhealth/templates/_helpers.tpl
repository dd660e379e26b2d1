{{/* The labels every object of the release carries, besides its own. */}}
{{- define "gpuhealth.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: gpuhealth
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* An image reference: repository, then tag (the appVersion when empty),
     then digest when one is set. Takes (list $root $image). */}}
{{- define "gpuhealth.image" -}}
{{- $root := index . 0 -}}{{- $image := index . 1 -}}
{{- $ref := printf "%s:%s" $image.repository ($image.tag | default $root.Chart.AppVersion) -}}
{{- if $image.digest -}}{{- $ref = printf "%s@%s" $ref $image.digest -}}{{- end -}}
{{- $ref -}}
{{- end }}

{{/* The condition types a policy may act on, as the ConfigMap
     gpuhealth-guardrails holds them: comma-separated. */}}
{{- define "gpuhealth.conditionTypes" -}}
{{- join "," .Values.operator.guardrails.conditionTypes -}}
{{- end }}

{{/* The objects of a file of the repository's config/ (files/ here), as
     kustomize would place them in this release: the install's namespace
     (gpuhealth-system there) becomes the release's, the validation
     namespace the chart's value, in metadata and in subjects alike; the
     condition types of gpuhealth-guardrails go into an admission policy's
     conditionTypes variable, as config/default's replacements put them;
     the release's labels are added. Takes (list $root "files/path.yaml"). */}}
{{- define "gpuhealth.config" -}}
{{- $root := index . 0 -}}
{{- $names := dict "gpuhealth-system" $root.Release.Namespace "gpuhealth-validation" $root.Values.validation.namespace -}}
{{- $labels := include "gpuhealth.labels" $root | fromYaml -}}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" ($root.Files.Get (index . 1)) -1 }}
{{- $object := fromYaml $doc -}}
{{- if $object.kind }}
{{- $metadata := $object.metadata -}}
{{- if hasKey $metadata "namespace" -}}
{{- $_ := set $metadata "namespace" (get $names $metadata.namespace | default $metadata.namespace) -}}
{{- end -}}
{{- if eq $object.kind "Namespace" -}}
{{- $_ := set $metadata "name" (get $names $metadata.name | default $metadata.name) -}}
{{- end -}}
{{- if eq $object.kind "ValidatingAdmissionPolicy" -}}
{{- range $variable := $object.spec.variables | default list -}}
{{- if eq $variable.name "conditionTypes" -}}
{{- $_ := set $variable "expression" (printf "'%s'.split(',')" (include "gpuhealth.conditionTypes" $root)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $subject := $object.subjects | default list -}}
{{- if hasKey $subject "namespace" -}}
{{- $_ := set $subject "namespace" (get $names $subject.namespace | default $subject.namespace) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $metadata "labels" (merge ($metadata.labels | default dict) $labels) }}
---
{{ toYaml $object }}
{{- end }}
{{- end }}
{{- end }}

{{/* What both agent pods share: where they run and at what priority. */}}
{{- define "gpuhealth.agentPod" -}}
{{- $a := .Values.agent -}}
{{- with $a.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $a.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $a.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if eq $a.nvml.source "containerToolkit" }}
runtimeClassName: {{ $a.nvml.runtimeClassName }}
{{- end }}
{{- end }}

{{/* The environment that tells the agent where NVML is. */}}
{{- define "gpuhealth.nvmlEnv" -}}
{{- if eq .Values.agent.nvml.source "containerToolkit" -}}
- {name: NVIDIA_VISIBLE_DEVICES, value: all}
- {name: NVIDIA_DRIVER_CAPABILITIES, value: utility}
{{- else -}}
- {name: GPUHEALTH_DRIVER_ROOT, value: /driver-root}
{{- end }}
{{- end }}

{{/* Privileged only for a driver root: the host's GPU device nodes open
     to a privileged container alone. */}}
{{- define "gpuhealth.nvmlPrivilege" -}}
{{- $privileged := eq .Values.agent.nvml.source "driverRoot" -}}
privileged: {{ $privileged }}
allowPrivilegeEscalation: {{ $privileged }}
{{- end }}

{{- define "gpuhealth.driverRootVolume" -}}
{{- if eq .Values.agent.nvml.source "driverRoot" -}}
- name: driver-root
  hostPath: {path: {{ .Values.agent.nvml.driverRoot }}, type: Directory}
{{- end }}
{{- end }}
