# The producer: a Cloud Run Job that reads what is new in BigQuery since each stream's watermark,
# enqueues it into pubsub_outbox and exits. Cloud Scheduler starts one execution per tick
# (scheduler.tf). Overlapping executions are safe: a stream already running elsewhere is skipped
# (OUTBOX_PRODUCER_ON_OVERLAP=skip) under a per-stream advisory lock.

resource "google_cloud_run_v2_job" "producer" {
  name                = "${var.name_prefix}-producer"
  location            = var.region
  deletion_protection = var.deletion_protection

  template {
    # Streams are split over the tasks: task i runs the streams at sorted positions p with
    # p % task_count == i (CLOUD_RUN_TASK_INDEX / CLOUD_RUN_TASK_COUNT, set by Cloud Run).
    task_count  = var.producer_task_count
    parallelism = var.producer_task_count

    template {
      service_account = google_service_account.producer.email
      # Per attempt, below the 15-minute schedule so executions do not pile up. On timeout the task
      # gets SIGTERM: the producer stops at a page boundary; the committed pages and watermark
      # stay, and the next run resumes there.
      timeout = var.producer_timeout
      # A retry resumes from the last committed page (exit 1); a config error (exit 2) fails again.
      max_retries           = var.producer_max_retries
      execution_environment = "EXECUTION_ENVIRONMENT_GEN2"

      # Cloud SQL has only a private IP: route private ranges through the VPC (the proxy sidecar
      # reaches the instance there; Google APIs go out directly).
      vpc_access {
        network_interfaces {
          network    = var.network
          subnetwork = var.run_subnetwork
        }
        egress = "PRIVATE_RANGES_ONLY"
      }

      containers {
        name  = "producer"
        image = var.producer_image
        args  = ["run"]
        # Started once the proxy's startup probe passes (below), so the first connection finds it.
        depends_on = ["cloud-sql-proxy"]

        resources {
          limits = {
            cpu    = var.producer_cpu
            memory = var.producer_memory
          }
        }

        env {
          name  = "OUTBOX_LOG_FORMAT"
          value = "json"
        }
        env {
          name  = "OUTBOX_PRODUCER_CONFIG"
          value = "/etc/pubsub-outbox/streams.toml"
        }
        env {
          # Through the proxy sidecar below, which logs in as the job's service account (IAM
          # database authentication): a user name and no password, so nothing here is secret.
          name  = "DATABASE_URL"
          value = local.producer_database_url
        }
        env {
          # Streams run one after the other on one dedicated connection (which holds the
          # stream's lock); the pool only serves the odd statement around it.
          name  = "OUTBOX_DB_POOL_SIZE"
          value = "2"
        }
        env {
          name  = "BIGQUERY_PROJECT_ID"
          value = local.bigquery_project_id
        }
        env {
          # For short topic names in the streams file.
          name  = "PUBSUB_PROJECT_ID"
          value = var.project_id
        }
        env {
          # The default, spelled out: a tick that finds a stream still running skips it.
          name  = "OUTBOX_PRODUCER_ON_OVERLAP"
          value = "skip"
        }
        # Tracing (tracing_enabled; docs/tracing.md): each execution is a trace its messages
        # continue. The job's service account has roles/cloudtrace.agent then (iam.tf).
        dynamic "env" {
          for_each = var.tracing_enabled ? {
            OUTBOX_TRACE_ENDPOINT     = var.trace_endpoint
            OUTBOX_TRACE_SAMPLE_RATIO = tostring(var.trace_sample_ratio)
            OUTBOX_TRACE_PROJECT      = var.project_id
          } : {}
          content {
            name  = env.key
            value = env.value
          }
        }
        env {
          # The task ends when its containers have exited: as it exits (success, failure or a
          # signal) the producer tells the proxy sidecar to exit too (its --quitquitquit below).
          name  = "OUTBOX_SIDECAR_QUIT_URL"
          value = "http://127.0.0.1:9091/quitquitquit"
        }

        volume_mounts {
          name       = "streams"
          mount_path = "/etc/pubsub-outbox"
        }
      }

      # The Cloud SQL Auth Proxy as a sidecar, not Cloud Run's built-in /cloudsql socket: the
      # built-in connection cannot do automatic IAM database authentication (it needs a password),
      # and a token-as-password would need the producer to mint and refresh OAuth tokens itself.
      # The proxy logs in as the job's service account and presents the client certificate the
      # instance requires. The producer starts after the proxy's startup probe passes (its
      # /startup answers 200 once the proxy is ready), and still retries its first connection
      # (OUTBOX_DB_CONNECT_TIMEOUT); it stops the proxy as it exits (OUTBOX_SIDECAR_QUIT_URL).
      containers {
        name  = "cloud-sql-proxy"
        image = var.cloud_sql_proxy_image
        args = [
          "--private-ip",
          "--auto-iam-authn",
          "--address=127.0.0.1",
          "--port=5432",
          "--structured-logs",
          "--exit-zero-on-sigterm",
          # On a task's timeout Cloud Run sends SIGTERM to both containers at once (this is no native
          # sidecar): keep serving the producer's open connection while it commits its last page
          # (it stops the proxy itself as it exits, through quitquitquit).
          "--max-sigterm-delay=20s",
          # POST http://127.0.0.1:9091/quitquitquit stops the proxy; the producer calls it as it
          # exits (see deploy/README.md: how a task with a sidecar ends).
          "--quitquitquit",
          "--admin-port=9091",
          # /startup, /readiness, /liveness on 9090, for the startup probe below.
          "--health-check",
          "--http-address=0.0.0.0",
          "--http-port=9090",
          google_sql_database_instance.outbox.connection_name,
        ]
        startup_probe {
          http_get {
            path = "/startup"
            port = 9090
          }
          # The provider's schema: timeout_seconds must be smaller than period_seconds. 60 s in all.
          period_seconds    = 2
          timeout_seconds   = 1
          failure_threshold = 30
        }
        resources {
          limits = {
            cpu    = "1"
            memory = "256Mi"
          }
        }
      }

      volumes {
        name = "streams"
        secret {
          secret       = google_secret_manager_secret.producer_streams.secret_id
          default_mode = 292 # 0444
          items {
            # The version this apply wrote, not "latest": a changed streams file is a change of
            # the job, seen in the plan, and an execution never reads a version newer than its
            # template.
            version = google_secret_manager_secret_version.producer_streams.version
            path    = "streams.toml"
          }
        }
      }
    }
  }

  lifecycle {
    # A timeout at or above the schedule's interval lets executions pile up: refuse the plan
    # (a check block would only warn). Only "*/N * * * *" schedules are compared (try: any other
    # form passes).
    precondition {
      condition = try(
        tonumber(trimsuffix(var.producer_timeout, "s")) < 60 * tonumber(regex("^\\*/([0-9]+) ", var.producer_schedule)[0]),
        true,
      )
      error_message = "producer_timeout must be shorter than the producer_schedule interval."
    }
  }

  depends_on = [
    google_project_service.enabled,
    google_secret_manager_secret_version.producer_streams,
    google_secret_manager_secret_iam_member.producer_reads_streams,
    google_project_iam_member.cloudsql,
    google_sql_user.workload,
  ]
}
