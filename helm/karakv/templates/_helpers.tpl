{{/* Names, labels and the pieces the sidecar and DaemonSet pods share. */}}
{{- define "karakv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "karakv.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The label whose value Prometheus takes as the job of karakvd's series: the ServiceMonitor reads it
from the metrics Service, the PodMonitor from the pods (jobLabel). Its value is karakv.name, so
the PrometheusRule selects job="<karakv.name>" and the two cannot disagree.
*/}}
{{- define "karakv.jobLabel" -}}
app.kubernetes.io/name
{{- end -}}

{{/*
What the PrometheusRule's selectors match in place of deploy/prometheus/alerts.yml's job="karakv":
the job above, this release's namespace, and the release itself (the ServiceMonitor and PodMonitor
copy the app.kubernetes.io/instance label onto the series as app_kubernetes_io_instance), so two
releases of the chart never alert on each other's daemons, in one namespace or in two.
*/}}
{{- define "karakv.ruleSelector" -}}
{{- printf "job=\"%s\",namespace=\"%s\",app_kubernetes_io_instance=\"%s\"" (include "karakv.name" .) .Release.Namespace .Release.Name -}}
{{- end -}}

{{- define "karakv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "karakv.selectorLabels" . }}
{{- end -}}

{{- define "karakv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "karakv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}

{{- define "karakv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "karakv.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* karakvd's image: <repository>:<tag or appVersion>, and @<digest> when image.digest pins it. */}}
{{- define "karakv.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- with .Values.image.digest -}}
{{- if not (regexMatch "^sha256:[a-f0-9]{64}$" .) -}}
{{- fail (printf "image.digest=%s is not a digest; expected sha256:<64 lowercase hex digits>" .) -}}
{{- end -}}
{{- $ref = printf "%s@%s" $ref . -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* The heartbeat file karakvd keeps fresh (--heartbeat_file's default, <socket>.alive). */}}
{{- define "karakv.heartbeat" -}}
{{- printf "%s.alive" (include "karakv.socket" .) -}}
{{- end -}}

{{/* Where the TLS Secret is mounted in karakvd's container. */}}
{{- define "karakv.prefixTierDir" -}}
/etc/karakv/prefix-tier
{{- end -}}

{{- define "karakv.tlsDir" -}}
/etc/karakv/tls
{{- end -}}

{{- define "karakv.socket" -}}
{{- printf "%s/karakv.sock" .Values.socketDir -}}
{{- end -}}

{{/* Probe handler: exec of the CLI on the Unix socket, or the kubelet's gRPC probe on TCP. */}}
{{- define "karakv.probeHandler" -}}
{{- if eq .Values.probes.type "grpc" }}
grpc:
  port: {{ .Values.probes.grpcPort }}
{{- else if eq .Values.probes.type "exec" }}
exec:
  command: ["karakv", "--target=unix:{{ include "karakv.socket" . }}", "--timeout={{ .Values.probes.timeoutSeconds }}", "health"]
{{- else }}
{{- fail (printf "probes.type=%s unknown; expected exec or grpc" .Values.probes.type) }}
{{- end }}
timeoutSeconds: {{ .Values.probes.timeoutSeconds }}
{{- end -}}

{{/* The karakvd container (also the native sidecar). */}}
{{- define "karakv.daemonContainer" -}}
name: karakvd
image: {{ include "karakv.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command: ["karakvd"]
args: ["--config=/etc/karakv/karakvd.conf"]
{{- if and .Values.sidecar.native (eq .Values.mode "sidecar") }}
restartPolicy: Always
{{- end }}
ports:
{{- if .Values.metrics.enabled }}
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- end }}
{{- if eq .Values.probes.type "grpc" }}
  - name: grpc
    containerPort: {{ .Values.probes.grpcPort }}
    protocol: TCP
{{- end }}
{{- if .Values.kvEvents.enabled }}
  - name: kv-events
    containerPort: {{ .Values.kvEvents.port }}
    protocol: TCP
{{- if .Values.kvEvents.replayPort }}
  - name: kv-events-replay
    containerPort: {{ .Values.kvEvents.replayPort }}
    protocol: TCP
{{- end }}
{{- end }}
{{- if .Values.tls.secretName }}
  - name: grpc-tls
    containerPort: {{ .Values.tls.port }}
    protocol: TCP
{{- end }}
startupProbe:
  {{- include "karakv.probeHandler" . | trim | nindent 2 }}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
livenessProbe:
  exec:
    command: ["karakv", "--heartbeat_file={{ include "karakv.heartbeat" . }}", "--max_age={{ .Values.probes.liveness.maxAgeSeconds }}", "liveness"]
  timeoutSeconds: {{ .Values.probes.timeoutSeconds }}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  {{- include "karakv.probeHandler" . | trim | nindent 2 }}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  {{- include "karakv.containerSecurityContext" . | nindent 2 }}
{{- if .Values.mps.enabled }}
env:
  {{- include "karakv.mpsEnv" . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- include "karakv.mpsMount" . | nindent 2 }}
  - name: karakv-socket
    mountPath: {{ .Values.socketDir }}
  - name: dshm
    mountPath: /dev/shm
  - name: config
    mountPath: /etc/karakv
    readOnly: true
{{- if .Values.tls.secretName }}
  - name: tls
    mountPath: {{ include "karakv.tlsDir" . }}
    readOnly: true
{{- end }}
{{- if and .Values.prefixTier.address .Values.prefixTier.passwordSecret }}
  - name: prefix-tier
    mountPath: {{ include "karakv.prefixTierDir" . }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The pod volumes of the Secrets only karakvd mounts: TLS, the prefix tier's password (listed
after the chart's other volumes). */}}
{{- define "karakv.secretVolumes" -}}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and .Values.prefixTier.address .Values.prefixTier.passwordSecret }}
- name: prefix-tier
  secret:
    secretName: {{ .Values.prefixTier.passwordSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.prefixTier.passwordKey }}
        path: {{ .Values.prefixTier.passwordKey }}
{{- end }}
{{- end -}}

{{/* MPS (values.yaml, mps): the client side's environment, mount and pod volume; empty when off. */}}
{{- define "karakv.mpsEnv" -}}
{{- if .Values.mps.enabled }}
- name: CUDA_MPS_PIPE_DIRECTORY
  value: {{ .Values.mps.pipeDirectory | quote }}
{{- end }}
{{- end -}}
{{- define "karakv.mpsMount" -}}
{{- if .Values.mps.enabled }}
- name: nvidia-mps
  mountPath: {{ .Values.mps.pipeDirectory }}
{{- end }}
{{- end -}}
{{- define "karakv.mpsVolume" -}}
{{- if .Values.mps.enabled }}
- name: nvidia-mps
  hostPath:
    path: {{ .Values.mps.pipeDirectory }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "karakv.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "karakv.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "karakv.podCommon" -}}
serviceAccountName: {{ include "karakv.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ add (int .Values.config.drain_seconds) 10 }}
{{- end -}}
