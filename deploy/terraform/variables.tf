# ---- project ------------------------------------------------------------------------------------

variable "project_id" {
  description = "Project that holds every resource created here."
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

variable "labels" {
  description = "Extra labels for every resource that takes labels."
  type        = map(string)
  default     = {}
}

# ---- Pub/Sub ------------------------------------------------------------------------------------

variable "topics" {
  description = <<-EOT
    Short names of the topics the outbox publishes to. The dispatcher may publish only to these:
    a row for any other topic fails with PERMISSION_DENIED and is dead-lettered.
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

variable "db_user" {
  description = "Built-in PostgreSQL user of both binaries (it owns the schema: they run migrations)."
  type        = string
  default     = "outbox"
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

variable "gke_namespace" {
  description = "Namespace of the dispatcher (deploy/k8s/common/namespace.yaml)."
  type        = string
  default     = "pubsub-outbox"
}

variable "gke_service_account" {
  description = "Kubernetes service account of the dispatcher (deploy/k8s/common/serviceaccount.yaml)."
  type        = string
  default     = "pubsub-outbox-dispatcher"
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

variable "producer_image" {
  description = "Producer image (deploy/docker/Dockerfile, --target producer), ideally by digest."
  type        = string
}

variable "producer_config_file" {
  description = "Path of the streams file (TOML) stored in Secret Manager and mounted into the job."
  type        = string
  default     = "streams.toml"
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

variable "producer_schedule_paused" {
  description = "Pause the schedule (the job can still be run by hand)."
  type        = bool
  default     = false
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
  description = "Longest one task attempt may run (e.g. \"3600s\"); keep it below the schedule interval."
  type        = string
  default     = "3600s"

  validation {
    condition     = can(regex("^[0-9]+s$", var.producer_timeout))
    error_message = "producer_timeout: whole seconds with an s suffix, e.g. \"3600s\"."
  }
}

variable "producer_cpu" {
  description = "vCPUs of a producer task (Cloud Run: 1, 2, 4, 6 or 8)."
  type        = string
  default     = "1"
}

variable "producer_memory" {
  description = "Memory of a producer task; one BigQuery page is held at a time (OUTBOX_PRODUCER_PAGE_SIZE rows)."
  type        = string
  default     = "512Mi"
}

# ---- derived ------------------------------------------------------------------------------------

locals {
  gke_project_id      = coalesce(var.gke_project_id, var.project_id)
  bigquery_project_id = coalesce(var.bigquery_project_id, var.project_id)
  # GKE's Workload Identity member for the dispatcher's Kubernetes service account.
  dispatcher_workload_identity_member = "serviceAccount:${local.gke_project_id}.svc.id.goog[${var.gke_namespace}/${var.gke_service_account}]"
}
