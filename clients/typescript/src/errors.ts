// The registry's errors, typed from the google.rpc.ErrorInfo they carry,
// as the Go client's are: a caller tests `err instanceof InProgressError`
// or `isReason(err, ErrorReason.FINGERPRINT_MISMATCH)` instead of parsing
// codes and messages.
import { Code, ConnectError } from "@connectrpc/connect";
import { durationMs } from "@bufbuild/protobuf/wkt";
import { BadRequestSchema, ErrorInfoSchema, RetryInfoSchema } from "./gen/google/rpc/error_details_pb.js";
import { ErrorReason } from "./gen/idemreg/v1/error_reason_pb.js";
import type { Record } from "./gen/idemreg/v1/registry_pb.js";

/** The ErrorInfo domain of every error of the registry. */
export const ErrorDomain = "idemreg.dev";

/**
 * The ErrorInfo reason that carries r: its name without the ERROR_REASON_
 * prefix ("LEASE_LOST"), "" for UNSPECIFIED or a value this version does
 * not know.
 */
export function reasonOf(r: ErrorReason): string {
  return r === ErrorReason.UNSPECIFIED ? "" : (ErrorReason[r] ?? "");
}

/** Reasons of the clients' own answers, beside ErrorReason's. */
export const ClientReason = {
  InProgress: "IN_PROGRESS",
  RegistryUnavailable: "REGISTRY_UNAVAILABLE",
} as const;

export interface FieldViolation {
  field: string;
  description: string;
}

/**
 * An error of the registry: its gRPC code, and what the status's details
 * say (ErrorInfo's reason and metadata, BadRequest's field violations,
 * RetryInfo's delay).
 */
export class IdemregError extends Error {
  override name = "IdemregError";
  readonly code: Code;
  /** ErrorInfo.reason ("FINGERPRINT_MISMATCH"), "" when the status had none (a transport error). */
  readonly reason: string;
  readonly metadata: { [k: string]: string };
  readonly fieldViolations: FieldViolation[];
  /** RetryInfo's delay in milliseconds, 0 when the status had none. */
  readonly retryAfterMs: number;

  constructor(
    message: string,
    init: { code: Code; reason?: string; metadata?: { [k: string]: string }; fieldViolations?: FieldViolation[]; retryAfterMs?: number; cause?: unknown },
  ) {
    super(message, { cause: init.cause });
    this.code = init.code;
    this.reason = init.reason ?? "";
    this.metadata = init.metadata ?? {};
    this.fieldViolations = init.fieldViolations ?? [];
    this.retryAfterMs = init.retryAfterMs ?? 0;
  }
}

/**
 * The registry (or its store) cannot answer now: nothing was decided.
 * Retry after retryAfterMs.
 */
export class UnavailableError extends IdemregError {
  override name = "UnavailableError";
}

/**
 * Another holder has a live claim on the key. once() throws it without
 * running the handler (or, with `wait`, after waiting in vain).
 */
export class InProgressError extends IdemregError {
  override name = "InProgressError";
  constructor(retryAfterMs: number) {
    super(`idemreg: ${ClientReason.InProgress}: the key is in progress elsewhere; retry after ${retryAfterMs}ms`, {
      code: Code.Aborted,
      reason: ClientReason.InProgress,
      retryAfterMs,
    });
  }
}

/**
 * The key is parked (its holder parked it, or its attempts reached the
 * consumer's max_attempts): the work must not be done until an operator
 * resolves it. Not final: dead-letter or skip the message.
 */
export class ParkedError extends IdemregError {
  override name = "ParkedError";
  readonly record: Record;
  constructor(record: Record) {
    super(`idemreg: PARKED: the key is parked (${record.parkReason}); do not do the work`, {
      code: Code.FailedPrecondition,
      reason: reasonOf(ErrorReason.PARKED),
    });
    this.record = record;
  }
}

/** Whether err is an IdemregError with reason r. */
export function isReason(err: unknown, r: ErrorReason | string): boolean {
  const want = typeof r === "string" ? r : reasonOf(r);
  return err instanceof IdemregError && err.reason === want;
}

const unavailableReasons = new Set([reasonOf(ErrorReason.STORE_UNAVAILABLE), reasonOf(ErrorReason.OVERLOADED), ""]);

/**
 * The typed error of a failed call: an UnavailableError for UNAVAILABLE
 * (the store, an overload, or the transport), else an IdemregError; a
 * value that is no ConnectError is converted as connect does (an abort is
 * CANCELED, anything else UNKNOWN).
 */
export function fromError(e: unknown): IdemregError {
  if (e instanceof IdemregError) {
    return e;
  }
  const ce = ConnectError.from(e);
  const info = ce.findDetails(ErrorInfoSchema)[0];
  const retry = ce.findDetails(RetryInfoSchema)[0];
  const bad = ce.findDetails(BadRequestSchema)[0];
  const init = {
    code: ce.code,
    reason: info?.reason ?? "",
    metadata: info ? { ...info.metadata } : {},
    fieldViolations: bad?.fieldViolations.map((v) => ({ field: v.field, description: v.description })) ?? [],
    retryAfterMs: retry?.retryDelay ? durationMs(retry.retryDelay) : 0,
    cause: e,
  };
  const msg = `idemreg: ${Code[ce.code]}${init.reason ? " " + init.reason : ""}: ${ce.rawMessage}`;
  if (ce.code === Code.Unavailable && unavailableReasons.has(init.reason)) {
    return new UnavailableError(msg, init);
  }
  return new IdemregError(msg, init);
}

/**
 * A handler's failure that no retry can change: once() stores it and
 * replays it to every duplicate. Throw `final(err)` (with the gRPC code to
 * store, UNKNOWN by default).
 */
export class FinalError extends Error {
  override name = "FinalError";
  readonly code: Code;
  constructor(message: string, code: Code = Code.Unknown, cause?: unknown) {
    super(message, { cause });
    this.code = code;
  }
}

/** Marks err as final (see FinalError). */
export function final(err: unknown, code: Code = Code.Unknown): FinalError {
  if (err instanceof FinalError) {
    return err;
  }
  const message = err instanceof Error ? err.message : String(err);
  return new FinalError(message, code, err);
}

/** A final failure replayed from the registry: what an earlier run stored. */
export class StoredFailureError extends FinalError {
  override name = "StoredFailureError";
}

/** Whether err is a final failure: thrown with final(), or replayed. */
export function isFinal(err: unknown): boolean {
  return err instanceof FinalError;
}

/**
 * The handler succeeded but its outcome was not recorded (the registry was
 * unreachable through the bookkeeping timeout, or the claim was lost):
 * the effect happened, and a redelivery after the lease runs the handler
 * again, with a larger token.
 */
export class NotRecordedError<T = unknown> extends Error {
  override name = "NotRecordedError";
  readonly value: T;
  constructor(value: T, cause: unknown) {
    super(`idemreg: the handler succeeded but its outcome was not recorded: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
    this.value = value;
  }
}
