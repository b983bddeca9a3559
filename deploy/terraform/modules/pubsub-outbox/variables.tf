# ---- project ------------------------------------------------------------------------------------

variable "project_id" {
  description = "Project that holds every resource created here (the environment's provider project; labels are the provider's default_labels)."
  type        = string
}

variable "region" {
  description = <<-EOT
    Region of Cloud SQL, the Cloud Run Job and the scheduler. Run the GKE cluster here too and
    point the dispatcher at this region's Pub/Sub endpoint (strict ordering holds within one region).
  EOT
  type        = string
}

variable "name_prefix" {
  description = "Prefix of every resource name (service account ids are <prefix>-dispatcher etc.)."
  type        = string
  default     = "pubsub-outbox"

  validation {
    # Service account ids are 6-30 characters; "-dispatcher" is the longest suffix.
    condition     = can(regex("^[a-z][a-z0-9-]{2,18}$", var.name_prefix))
    error_message = "name_prefix: 3-19 lowercase letters, digits or hyphens, starting with a letter."
  }
}

# ---- Pub/Sub ------------------------------------------------------------------------------------

variable "topics" {
  description = <<-EOT
    Short names of the topics the outbox publishes to. The dispatcher may publish only to these:
    Pub/Sub refuses a row for any other topic with PERMISSION_DENIED (NOT_FOUND if it does not
    exist), and the dispatcher holds that topic (its rows wait untouched, probed until the topic
    answers; alert OutboxTopicHeld): it never dead-letters messages for a refused topic.
  EOT
  type        = list(string)

  validation {
    condition     = length(var.topics) > 0
    error_message = "topics: list at least one topic."
  }
}

variable "topic_message_retention" {
  description = "How long topics keep published messages, acknowledged or not (replay with seek)."
  type        = string
  default     = "604800s" # 7 days
}

variable "topic_persistence_regions" {
  description = <<-EOT
    Regions where Pub/Sub may store messages (empty: no restriction). A single region keeps data
    resident there; publishing then depends on that region being up (the outbox just waits).
  EOT
  type        = list(string)
  default     = []
}

variable "create_example_subscriptions" {
  description = "Create one pull subscription per topic (<topic>-example) as a starting point for consumers."
  type        = bool
  default     = true
}

variable "subscription_message_retention" {
  description = "How long the example subscriptions keep unacknowledged messages."
  type        = string
  default     = "604800s" # 7 days, the maximum
}

# ---- network ------------------------------------------------------------------------------------

variable "network" {
  description = <<-EOT
    VPC (projects/PROJECT/global/networks/NAME) that reaches Cloud SQL's private IP through
    Private Service Access. The GKE cluster and the Cloud Run Job's subnet must be on it.
  EOT
  type        = string
}

variable "create_private_service_access" {
  description = <<-EOT
    Reserve a range and create the Private Service Access peering on var.network. Leave false
    when the VPC already has one: there is one such connection per network, and re-creating it
    rewrites its reserved ranges for every service using it.
  EOT
  type        = bool
  default     = false
}

variable "private_service_access_prefix_length" {
  description = "Size of the range reserved for Private Service Access (when created here)."
  type        = number
  default     = 20
}

variable "run_subnetwork" {
  description = "Subnet (in var.region, on var.network) for the Cloud Run Job's Direct VPC egress."
  type        = string
}

# ---- Cloud SQL ----------------------------------------------------------------------------------

variable "postgres_version" {
  description = <<-EOT
    Cloud SQL database_version of a new instance. POSTGRES_15 by default: the version the test
    suite and the Cloud SQL rehearsal run on (the only one the development machines have). 16 to
    18 are accepted (the schema is written for them) but untested; 15 reaches community end of
    life in November 2027. Changing it on an existing instance is a major version upgrade (in
    place, with downtime): read deploy/README.md first.
  EOT
  type        = string
  default     = "POSTGRES_15"

  validation {
    condition     = contains(["POSTGRES_15", "POSTGRES_16", "POSTGRES_17", "POSTGRES_18"], var.postgres_version)
    error_message = "postgres_version: one of POSTGRES_15, POSTGRES_16, POSTGRES_17, POSTGRES_18."
  }
}

variable "db_tier" {
  description = "Cloud SQL machine type (Enterprise edition)."
  type        = string
  default     = "db-custom-2-7680"
}

variable "db_availability_type" {
  description = "REGIONAL (a standby in another zone, automatic failover) or ZONAL."
  type        = string
  default     = "REGIONAL"
}

variable "db_disk_size_gb" {
  description = "Initial SSD size; it grows automatically."
  type        = number
  default     = 50
}

variable "db_max_connections" {
  description = <<-EOT
    PostgreSQL max_connections. Budget: dispatcher replicas x (OUTBOX_DB_POOL_SIZE + 1 LISTEN)
    + producer tasks x 3 + migrations + people. Changing it restarts the instance.
  EOT
  type        = number
  default     = 200
}

variable "db_name" {
  description = "Database that holds pubsub_outbox and the producer's state."
  type        = string
  default     = "outbox"
}

variable "kms_key_name" {
  description = <<-EOT
    Optional CMEK (projects/P/locations/L/keyRings/R/cryptoKeys/K, in var.region) for the Cloud
    SQL instance, the topics and the Artifact Registry repository; null: Google-managed keys. This
    module creates the Cloud SQL, Pub/Sub and Artifact Registry service agents and grants them
    roles/cloudkms.cryptoKeyEncrypterDecrypter on the key before it makes those (kms.tf): whoever
    applies needs to set the key's IAM policy. Cloud SQL and Artifact Registry take it only at
    creation.
  EOT
  type        = string
  default     = null
}

variable "enable_pgaudit" {
  description = "Turn on pgAudit for DDL and role changes (never statement parameters); then CREATE EXTENSION pgaudit once."
  type        = bool
  default     = false
}

variable "deletion_protection" {
  description = "Protect the Cloud SQL instance and the Cloud Run Job from deletion."
  type        = bool
  default     = true
}

# ---- GKE (the dispatcher) -----------------------------------------------------------------------

variable "gke_project_id" {
  description = "Project of the GKE cluster (its Workload Identity pool); null: var.project_id."
  type        = string
  default     = null
}

variable "gke_cluster_name" {
  description = <<-EOT
    Name of the GKE cluster the dispatcher runs in (`gcloud container clusters list`; the same as
    CLUSTER_NAME in deploy/k8s/dispatcher/hpa.yaml). The dispatcher's alert policies and the
    dashboard read only this cluster's series: Cloud Monitoring sees every cluster of the project.
  EOT
  type        = string

  validation {
    condition     = can(regex("^[a-z]([-a-z0-9]*[a-z0-9])?$", var.gke_cluster_name))
    error_message = "gke_cluster_name: a GKE cluster name (lowercase letters, digits and hyphens)."
  }
}

variable "gke_namespace" {
  description = "Namespace of the dispatcher (deploy/k8s/common/namespace.yaml). Must name what the manifests name: change it only with an overlay that renames it there too (deploy/check compares the default with deploy/k8s)."
  type        = string
  default     = "pubsub-outbox"
}

variable "gke_admin_namespace" {
  description = <<-EOT
    Namespace of the migration, operator and bootstrap Jobs (deploy/k8s/common/admin.yaml), apart
    from the dispatcher's: whoever may create pods in a namespace may run them as any of its
    service accounts, and these carry the schema's owner and the operators' rights.
    Must name what the manifests name: change it only with an overlay that renames it there too
    (deploy/check compares the default with deploy/k8s).
  EOT
  type        = string
  default     = "pubsub-outbox-admin"
}

variable "gke_service_account" {
  description = "Kubernetes service account of the dispatcher (deploy/k8s/serviceaccount.yaml). Must name what the manifests name: change it only with an overlay that renames it there too (deploy/check compares the default with deploy/k8s)."
  type        = string
  default     = "pubsub-outbox-dispatcher"
}

variable "gke_migrate_service_account" {
  description = "Kubernetes service account of the migration Job (deploy/k8s/migrate/serviceaccount.yaml). Must name what the manifests name: change it only with an overlay that renames it there too (deploy/check compares the default with deploy/k8s)."
  type        = string
  default     = "pubsub-outbox-migrate"
}

variable "gke_operator_service_account" {
  description = "Kubernetes service account of the operator Job (deploy/k8s/operator/serviceaccount.yaml). Must name what the manifests name: change it only with an overlay that renames it there too (deploy/check compares the default with deploy/k8s)."
  type        = string
  default     = "outbox-operator"
}

# ---- operators (people) -------------------------------------------------------------------------

variable "operators" {
  description = <<-EOT
    Email addresses (lowercase) of the people who run the operator commands (dispatcher status,
    dead-letters, pause, resume, audit; producer streams, rewind) as themselves, through a Cloud
    SQL Auth Proxy on their own machine. Each gets an IAM database user (its name is the email)
    and the two login roles on the instance; `terraform output database_bootstrap_command` then
    prints the bootstrap run that makes it a member of outbox_operator. People only: the
    in-cluster operator has its own service account.
  EOT
  type        = list(string)
  default     = []

  validation {
    # Cloud SQL wants IAM user names in lowercase, and a service account another user type; the
    # pattern also keeps quotes out of the printed bootstrap commands.
    condition = alltrue([
      for e in var.operators : can(regex("^[a-z0-9._%+-]+@[a-z0-9.-]+$", e)) && !endswith(e, ".gserviceaccount.com")
    ])
    error_message = "operators: lowercase email addresses of people (no service accounts)."
  }
}

variable "operator_groups" {
  description = <<-EOT
    Email addresses (lowercase) of Google groups whose members are all operators. The group gets
    an IAM database user (CLOUD_IAM_GROUP) and the login roles; each member logs in as their own
    email (Cloud SQL creates that login at the first connection) and inherits the group's
    outbox_operator membership. Joining or leaving the group then needs no Terraform or bootstrap
    run.
  EOT
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for e in var.operator_groups : can(regex("^[a-z0-9._%+-]+@[a-z0-9.-]+$", e))])
    error_message = "operator_groups: lowercase email addresses of Google groups."
  }
}

# ---- BigQuery (the producer) --------------------------------------------------------------------

variable "bigquery_project_id" {
  description = "Project the producer's query jobs run in and are billed to; null: var.project_id."
  type        = string
  default     = null
}

variable "bigquery_datasets" {
  description = "Datasets the producer's queries read (project null: var.project_id)."
  type = list(object({
    project    = optional(string)
    dataset_id = string
  }))
  default = []
}

# ---- the producer job ---------------------------------------------------------------------------

variable "producer_streams" {
  description = <<-EOT
    The producer's streams file (TOML), as text: stored in Secret Manager and mounted into the job.
    Each environment commits its own (environments/<env>/streams.toml) and passes
    file("$${path.module}/streams.toml"): never a git-ignored file, so every checkout applies the same.
  EOT
  type        = string

  validation {
    condition     = strcontains(var.producer_streams, "[[stream]]")
    error_message = "producer_streams: the streams file's text, with at least one [[stream]] table."
  }
}

variable "producer_schedule" {
  description = "Cron schedule of the producer (Cloud Scheduler syntax)."
  type        = string
  default     = "*/15 * * * *"
}

variable "producer_time_zone" {
  description = "Time zone of producer_schedule."
  type        = string
  default     = "Etc/UTC"
}

variable "producer_task_count" {
  description = "Parallel tasks per execution; streams are split over them by index (i % count)."
  type        = number
  default     = 1
}

variable "producer_max_retries" {
  description = "Retries of a failed task within one execution (a retry resumes at the watermark)."
  type        = number
  default     = 1
}

variable "producer_timeout" {
  description = <<-EOT
    Longest one task attempt may run, e.g. "600s". Keep it below the schedule interval (15 minutes
    by default), so an execution ends before the next tick starts another; a precondition on
    the job (cloudrun_job.tf) refuses the plan otherwise, for "*/N * * * *" schedules.
  EOT
  type        = string
  default     = "600s"

  validation {
    condition     = can(regex("^[0-9]+s$", var.producer_timeout))
    error_message = "producer_timeout: whole seconds with an s suffix, e.g. \"600s\"."
  }
}

variable "producer_cpu" {
  description = "vCPUs of a producer task (Cloud Run: 1, 2, 4, 6 or 8)."
  type        = string
  default     = "1"
}

variable "producer_memory" {
  description = "Memory of a producer task; it holds about OUTBOX_PRODUCER_READ_PARALLELISM + 3 BigQuery pages of OUTBOX_PRODUCER_PAGE_BYTES (93 MiB peak for 1,000,000 rows at the defaults, BENCHMARKS.md; flat whatever the result size)."
  type        = string
  default     = "512Mi"
}

# ---- monitoring ---------------------------------------------------------------------------------

variable "tracing_enabled" {
  description = "Export traces (docs/tracing.md): grants the dispatcher's and the producer's service accounts roles/cloudtrace.agent, enables the Telemetry API, and sets the producer job's OUTBOX_TRACE_* (the dispatcher's are in its ConfigMap). Off: no spans leave; the writers' context is still passed on to consumers."
  type        = bool
  default     = false
}

variable "trace_endpoint" {
  description = "The OTLP/gRPC endpoint of the traces: Cloud Trace's (the default, with the workload's credentials) or an OpenTelemetry Collector's (e.g. http://otel-collector.observability:4317)."
  type        = string
  default     = "https://telemetry.googleapis.com"
}

variable "trace_sample_ratio" {
  description = "The share of new traces the producer samples, 0 to 1 (parent-based: a sampled writer's message stays sampled)."
  type        = number
  default     = 0.1

  validation {
    condition     = var.trace_sample_ratio >= 0 && var.trace_sample_ratio <= 1
    error_message = "trace_sample_ratio is a share of traces: a number from 0 to 1."
  }
}

variable "alert_notification_channels" {
  description = "Cloud Monitoring notification channel ids (projects/P/notificationChannels/N) that page: the dispatcher's alerts labelled severity: page (deploy/k8s/alerts.yaml), the producer and database alerts. Required unless allow_alerts_without_notification."
  type        = list(string)
  default     = []
}

variable "alert_warning_notification_channels" {
  description = "Notification channel ids for the dispatcher's alerts labelled severity: warning (a ticket queue, an email list). Empty: they open incidents on the Cloud Monitoring console and notify nobody."
  type        = list(string)
  default     = []
}

variable "allow_alerts_without_notification" {
  description = "Accept alert policies with no notification channel (they then show on the console only). Off: an empty alert_notification_channels refuses the plan."
  type        = bool
  default     = false
}

# ---- the console (dispatcher console, behind IAP) -----------------------------------------------

variable "console_enabled" {
  description = <<-EOT
    Create what the operator console on GKE needs (deploy/k8s/console): its Google service account
    (an IAM database user, a member of outbox_operator after the bootstrap line printed for it),
    its Workload Identity binding, the reserved global address of its Ingress, and the IAP access
    of console_users.
  EOT
  type        = bool
  default     = false
}

variable "console_users" {
  description = <<-EOT
    Who may open the console, as IAM members ("user:alice@example.com", "group:oncall@example.com"):
    roles/iap.httpsResourceAccessor. What they may do there is the console's --actions switch
    (deploy/k8s/console/console.env); every change is audited with their email.
  EOT
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for m in var.console_users : can(regex("^(user|group):[a-z0-9._%+-]+@[a-z0-9.-]+$", m))])
    error_message = "console_users: \"user:EMAIL\" or \"group:EMAIL\", lowercase."
  }
}

variable "console_backend_service" {
  description = <<-EOT
    The name of the console's backend service, made by the GKE Ingress controller
    (`gcloud compute backend-services list --filter="name~pubsub-outbox-console"`). Empty: the IAP
    access of console_users is granted on every IAP-protected web backend of the project (fine
    while the console is the only one); set it after the first apply to narrow the grant to the
    console's backend.
  EOT
  type        = string
  default     = ""
}

variable "gke_console_service_account" {
  description = "Kubernetes service account of the console (deploy/k8s/console/serviceaccount.yaml). Must name what the manifests name: change it only with an overlay that renames it there too (deploy/check compares the default with deploy/k8s)."
  type        = string
  default     = "outbox-console"
}

# ---- Artifact Registry (the images) -------------------------------------------------------------

variable "artifact_registry_repository" {
  description = "The Docker repository (in var.region) of the dispatcher's and producer's images and the mirrored ones (the bootstrap Job's postgres): REGION-docker.pkg.dev/PROJECT/<this>."
  type        = string
  default     = "pubsub-outbox"
}

variable "create_artifact_registry_repository" {
  description = "Create var.artifact_registry_repository here. false when it exists already (made by hand or another configuration): the node account's read grant is still made on it."
  type        = bool
  default     = true
}

variable "gke_node_service_account" {
  description = <<-EOT
    Email of the GKE nodes' service account (the cluster's node pools run as it; the kubelet pulls
    images with it). It gets roles/artifactregistry.reader on the repository, so a private cluster
    pulls the images through Private Google Access, without Cloud NAT.
  EOT
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9._%+-]+@[a-z0-9.-]+\\.gserviceaccount\\.com$", var.gke_node_service_account))
    error_message = "gke_node_service_account: a service account's email (…@….gserviceaccount.com)."
  }
}

variable "custom_metrics_adapter_monitoring_viewer" {
  description = <<-EOT
    Grant roles/monitoring.viewer to the Custom Metrics Stackdriver Adapter's Kubernetes service
    account (custom-metrics/custom-metrics-stackdriver-adapter, through Workload Identity) in the
    GKE project: the dispatcher's HPAs read their external metric through it. false when the
    adapter runs under another identity that has the role already.
  EOT
  type        = bool
  default     = true
}

# ---- the release (each environment's release.auto.tfvars) ---------------------------------------
# The variables a release changes have no default, here and in each environment's variables.tf,
# and are set only in that environment's release.auto.tfvars, committed, which every plan and apply
# there reads: never with -var, -var-file or TF_VAR_, or the next apply without them puts the old
# value back (deploy/check refuses a document step that does).

variable "producer_image" {
  description = "Producer image (deploy/docker/Dockerfile, --target producer) by digest: REPO/producer@sha256:… (release.auto.tfvars)."
  type        = string

  validation {
    # A digest, and not the all-zero placeholder a template ships with: a tag can move under a
    # running schedule, and a placeholder would make an execution that cannot start.
    condition     = can(regex("^[^@\\s]+@sha256:[0-9a-f]{64}$", var.producer_image)) && !can(regex("@sha256:0{64}$", var.producer_image))
    error_message = "producer_image must name a real digest (REPO/producer@sha256:<64 hex>, not the all-zero placeholder): set the release's in release.auto.tfvars."
  }
}

variable "producer_schedule_paused" {
  description = "Pause the schedule (the job can still be run by hand). true until the first migration has run (release.auto.tfvars)."
  type        = bool
}

variable "alerts_enabled" {
  description = <<-EOT
    Make the alert policies (the dispatcher's, the producer's, the database's). false for the first
    apply: the dispatcher is not rolled out and the schema does not exist, so OutboxDispatcherAbsent
    and the producer would page for nothing; true once the dispatcher runs and the producer's
    schedule is on (deploy/README.md, section 4). In release.auto.tfvars.
  EOT
  type        = bool
}

variable "cloud_sql_proxy_image" {
  description = "Cloud SQL Auth Proxy image of the producer job's sidecar, by digest (tag@sha256:…; the same as deploy/k8s, deploy/check compares them). In release.auto.tfvars."
  type        = string

  validation {
    condition     = can(regex("^[^@\\s]+@sha256:[0-9a-f]{64}$", var.cloud_sql_proxy_image)) && !can(regex("@sha256:0{64}$", var.cloud_sql_proxy_image))
    error_message = "cloud_sql_proxy_image must name a real digest (…/cloud-sql-proxy:TAG@sha256:<64 hex>, not the all-zero placeholder)."
  }
}

# ---- derived ------------------------------------------------------------------------------------

locals {
  gke_project_id      = coalesce(var.gke_project_id, var.project_id)
  bigquery_project_id = coalesce(var.bigquery_project_id, var.project_id)
  # GKE's Workload Identity members: the Kubernetes service accounts of the dispatcher and the
  # console (gke_namespace), and of the migration, operator and bootstrap Jobs (gke_admin_namespace).
  dispatcher_workload_identity_member = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_namespace}/${var.gke_service_account}]"
  migrate_workload_identity_member    = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_admin_namespace}/${var.gke_migrate_service_account}]"
  operator_workload_identity_member   = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_admin_namespace}/${var.gke_operator_service_account}]"
  bootstrap_workload_identity_member  = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_admin_namespace}/pubsub-outbox-bootstrap]"
  console_workload_identity_member    = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_namespace}/${var.gke_console_service_account}]"
  # The IAM database users (cloudsql.tf) and the DATABASE_URLs through a proxy on 127.0.0.1:5432.
  # No password: the proxy (--auto-iam-authn) logs in with the workload's token. sslmode=disable
  # is the pod- or task-local hop; the proxy encrypts (TLS 1.3, client certificate) to Cloud SQL.
  db_users              = { for k, u in google_sql_user.workload : k => u.name }
  database_url_template = "postgres://%s@127.0.0.1:5432/${var.db_name}?sslmode=disable"
  database_urls         = { for k, name in local.db_users : k => format(local.database_url_template, urlencode(name)) }
  producer_database_url = local.database_urls["producer"]
}
