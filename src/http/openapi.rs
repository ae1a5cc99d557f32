//! `GET /openapi.json` (OpenAPI 3.1, generated from the handlers' annotations) and
//! `GET /docs` (an interactive page reading it).

use std::sync::LazyLock;

use axum::response::{Html, IntoResponse};
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::RefOr;
use utoipa::{Modify, OpenApi};

use super::{draws, health, live, orders, payments, sale_orders, seckill, vouchers};
use crate::http::error::{ErrorBody, ErrorCode, ErrorDetail};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "seckill",
        description = "Flash-sale vouchers: atomic admission in Redis, orders written to Postgres \
            moments later. Every error is `{\"error\": {\"code\", \"message\"}}`; bearer tokens are \
            JWTs: HS256, and RS256/ES256 of an identity provider when a JWKS is configured (`sub` = \
            user id, `exp` required, `role: \"admin\"` for administrators, `role: \"shop\"` with a `shop_id` \
            claim for a shop's staff). A provider's token gets \
            503 `unavailable` while its keys have never been fetched."
    ),
    paths(
        vouchers::create,
        vouchers::get,
        vouchers::list_by_shop,
        sale_orders::list_orders,
        vouchers::close,
        seckill::grab,
        draws::get,
        orders::get,
        orders::list_mine,
        orders::checkout,
        orders::pay,
        orders::redeem,
        orders::refund,
        orders::cancel,
        sale_orders::list_shop_orders,
        payments::notify,
        payments::list,
        health::healthz,
        health::readyz,
        health::metrics,
        openapi_json,
        docs,
        live::page,
        live::events,
    ),
    components(schemas(
        vouchers::CreateVoucher,
        vouchers::CreateSeckill,
        vouchers::VoucherResponse,
        vouchers::SeckillResponse,
        crate::domain::Opening,
        draws::DrawResponse,
        sale_orders::OrderPage,
        sale_orders::ListedStatus,
        seckill::Admitted,
        orders::OrderResponse,
        crate::domain::OrderStatus,
        orders::ManualPayment,
        orders::RedeemOrder,
        orders::Checkout,
        orders::PaymentView,
        payments::Notification,
        payments::Notified,
        crate::store::payments::EventRow,
        payments::PaymentPage,
        crate::store::payments::Kind,
        crate::store::payments::Outcome,
        crate::domain::RefundReason,
        crate::domain::PayType,
        ErrorBody,
        ErrorDetail,
        ErrorCode,
        crate::http::error::GrabOutcome,
    )),
    modifiers(&BearerAuth, &OptionalBodies, &LimitAnswers, &FlatObjects),
    tags(
        (name = "vouchers", description = "publishing and reading vouchers"),
        (name = "seckill", description = "the flash sale itself"),
        (name = "orders", description = "the caller's orders: checkout, redemption at the shop, refunds"),
        (name = "payments", description = "the payment provider's signed notifications"),
        (name = "operations", description = "health, readiness, metrics, this document"),
        (name = "live", description = "every open sale, live: a page and its event stream"),
    )
)]
pub(crate) struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
    }
}

/// An optional body (`Option<T>` in a `request_body`), which utoipa writes as a required
/// `oneOf [null, T]`, becomes `required: false` with `T`'s own schema: what it means
/// (no body at all is fine), and what client generators understand (with `oneOf`,
/// openapi-python-client sent a JSON `null`, or raised when given no body).
struct OptionalBodies;

impl Modify for OptionalBodies {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{schema::Schema, Required};
        for op in operations(openapi) {
            let Some(body) = op.request_body.as_mut() else {
                continue;
            };
            if body.required == Some(Required::True) {
                continue;
            }
            let mut unwrapped = false;
            for content in body.content.values_mut() {
                let Some(RefOr::T(Schema::OneOf(one_of))) = &content.schema else {
                    continue;
                };
                let mut items = one_of.items.iter().filter(|item| !is_null(item));
                if let (Some(only), None, true) =
                    (items.next(), items.next(), one_of.items.len() == 2)
                {
                    content.schema = Some(only.clone());
                    unwrapped = true;
                }
            }
            if unwrapped {
                body.required = Some(Required::False);
            }
        }
    }
}

/// A shape shared by `#[serde(flatten)]` (the voucher's terms in its answer), which
/// utoipa writes as an `allOf` of inline objects, becomes the one object it is on the
/// wire: generators differ on `allOf` (some make a class per member), none on an object.
struct FlatObjects;

impl Modify for FlatObjects {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::Schema;
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        for schema in components.schemas.values_mut() {
            let RefOr::T(Schema::AllOf(all_of)) = schema else {
                continue;
            };
            let mut members = all_of.items.iter().map(|item| match item {
                RefOr::T(Schema::Object(object)) => Some(object),
                _ => None,
            });
            let Some(Some(first)) = members.next() else {
                continue;
            };
            let mut merged = first.clone();
            merged.description = all_of.description.clone();
            for member in members {
                let Some(member) = member else { return };
                merged.properties.extend(member.properties.clone());
                merged.required.extend(member.required.iter().cloned());
            }
            *schema = RefOr::T(Schema::Object(merged));
        }
    }
}

fn is_null(schema: &RefOr<utoipa::openapi::schema::Schema>) -> bool {
    use utoipa::openapi::schema::{Schema, SchemaType, Type};
    matches!(schema, RefOr::T(Schema::Object(o)) if o.schema_type == SchemaType::Type(Type::Null))
}

/// Every operation of the document.
fn operations(openapi: &mut utoipa::openapi::OpenApi) -> impl Iterator<Item = &mut Operation> {
    openapi.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ]
        .into_iter()
        .filter_map(Option::as_mut)
    })
}

/// The answers of the server's own limits, in the JSON error format, on every operation
/// they can reach: 405 (another method on the path), 414 (the URL) and 431 (the head)
/// on every one, 413 on those that read a body. An operation keeps a description of
/// its own.
struct LimitAnswers;

impl Modify for LimitAnswers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        let error = |description: String| {
            utoipa::openapi::ResponseBuilder::new()
                .description(description)
                .content(
                    "application/json",
                    utoipa::openapi::ContentBuilder::new()
                        .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                        .build(),
                )
        };
        let kib = |bytes: usize| bytes / 1024;
        let method_not_allowed = error(
            "a method this path does not serve (`validation`); `Allow` lists those it does".into(),
        )
        .header(
            "Allow",
            HeaderBuilder::new()
                .schema(ObjectBuilder::new().schema_type(Type::String))
                .description(Some("the methods this path serves, e.g. `GET,HEAD`"))
                .build(),
        )
        .build();
        let too_large = error(format!(
            "a body over {} KiB (`validation`)",
            kib(super::BODY_LIMIT)
        ))
        .build();
        let uri_too_long = error(format!(
            "a URL (path and query) over {} KiB (`validation`)",
            kib(super::MAX_URL_BYTES)
        ))
        .build();
        let head_too_large = error(format!(
            "more than {} headers, or over {} KiB of URL and headers together (`validation`)",
            super::MAX_HEADERS,
            kib(super::MAX_HEADER_BYTES)
        ))
        .build();
        for op in operations(openapi) {
            let mut limits = vec![
                ("405", &method_not_allowed),
                ("414", &uri_too_long),
                ("431", &head_too_large),
            ];
            if op.request_body.is_some() {
                limits.push(("413", &too_large));
            }
            for (status, answer) in limits {
                op.responses
                    .responses
                    .entry(status.to_string())
                    .or_insert_with(|| RefOr::T(answer.clone()));
            }
        }
    }
}

static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes")
});

#[utoipa::path(get, path = "/openapi.json", operation_id = "getOpenApiDocument", tag = "operations",
    responses((status = 200, description = "this document (OpenAPI 3.1)", body = Object)))]
pub(crate) async fn openapi_json() -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
}

/// Swagger UI, served from assets built into the binary (nothing from a CDN: the page
/// works offline and behind a strict egress policy), pointed at our document.
#[utoipa::path(get, path = "/docs", operation_id = "getDocs", tag = "operations",
    responses((status = 200, description = "interactive API documentation (Swagger UI, served by this process)", content_type = "text/html", body = String)))]
pub(crate) async fn docs() -> Html<&'static str> {
    Html(
        r##"<!doctype html>
<html lang="en">
  <head>
    <title>seckill API</title>
    <meta charset="utf-8" />
    <meta name="viewport" content="width=device-width, initial-scale=1" />
    <link rel="stylesheet" href="/docs/swagger-ui.css" />
  </head>
  <body>
    <div id="swagger-ui"></div>
    <script src="/docs/swagger-ui-bundle.js"></script>
    <script>
      window.onload = () => {
        window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui" });
      };
    </script>
  </body>
</html>"##,
    )
}

/// The Swagger UI files `docs` loads (`swagger-ui.css`, `swagger-ui-bundle.js`), as the
/// `swagger-ui-dist` crate embeds them. Only these two names are served; the crate's
/// own index page (which echoes the request URI into its HTML) is never reachable.
pub(crate) async fn docs_asset(
    name: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
) -> axum::response::Response {
    let name = name.map(|p| p.0).unwrap_or_default();
    use tower::ServiceExt;
    static ASSETS: LazyLock<axum::Router> = LazyLock::new(|| {
        swagger_ui_dist::generate_routes(swagger_ui_dist::ApiDefinition {
            uri_prefix: "/assets",
            api_definition: swagger_ui_dist::OpenApiSource::Uri("/openapi.json"),
            title: Some("seckill API"),
        })
    });
    if !matches!(name.as_str(), "swagger-ui.css" | "swagger-ui-bundle.js") {
        return crate::http::error::AppError::NotFound("no such route".into()).into_response();
    }
    let request = axum::http::Request::get(format!("/assets/{name}"))
        .body(axum::body::Body::empty())
        .expect("a valid request");
    match ASSETS.clone().oneshot(request).await {
        Ok(mut response) => {
            response.headers_mut().insert(
                axum::http::header::CACHE_CONTROL,
                axum::http::HeaderValue::from_static("public, max-age=86400"),
            );
            response
        }
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_covers_every_route() {
        let doc: serde_json::Value = serde_json::from_str(&DOCUMENT).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
        for path in [
            "/vouchers",
            "/vouchers/{id}",
            "/vouchers/{id}/seckill",
            "/vouchers/{id}/orders",
            "/vouchers/{id}/close",
            "/shops/{shop_id}/vouchers",
            "/orders",
            "/orders/{order_id}",
            "/orders/{order_id}/checkout",
            "/orders/{order_id}/pay",
            "/orders/{order_id}/redeem",
            "/orders/{order_id}/refund",
            "/orders/{order_id}/cancel",
            "/shops/{shop_id}/orders",
            "/payments/notifications",
            "/payments",
            "/healthz",
            "/readyz",
            "/metrics",
            "/openapi.json",
            "/docs",
        ] {
            assert!(doc["paths"].get(path).is_some(), "{path} missing");
        }
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // An administrator's manual payment needs its reason.
        let pay = &doc["paths"]["/orders/{order_id}/pay"]["post"];
        assert_eq!(pay["requestBody"]["required"], true, "{pay}");
        assert_eq!(
            doc["components"]["schemas"]["ListedStatus"]["enum"],
            serde_json::json!(sale_orders::ListedStatus::ALL
                .map(|s| crate::domain::OrderStatus::from(s).as_str())),
            "the document's statuses are the ones the listing accepts"
        );
        let statuses = &doc["components"]["schemas"]["OrderStatus"]["enum"];
        assert_eq!(
            statuses,
            &serde_json::json!(crate::domain::OrderStatus::ALL.map(|s| s.as_str()))
        );
    }

    #[test]
    fn every_operation_has_an_id_of_its_own() {
        let doc: serde_json::Value = serde_json::from_str(&DOCUMENT).unwrap();
        let mut ids = std::collections::HashSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let id = op["operationId"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{method} {path}"));
                assert!(ids.insert(id.to_string()), "operationId {id} used twice");
            }
        }
        assert_eq!(ids.len(), 24, "every routed operation is documented");
    }

    fn document() -> serde_json::Value {
        serde_json::from_str(&DOCUMENT).unwrap()
    }

    /// Every operation of the document: (method, path, operation).
    fn operations(doc: &serde_json::Value) -> Vec<(String, String, serde_json::Value)> {
        let mut all = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                all.push((method.clone(), path.clone(), op.clone()));
            }
        }
        all
    }

    /// Order ids travel as strings in bodies (JavaScript loses precision above 2^53);
    /// in paths they are declared the same way, so a client never turns one into a
    /// float on its way back.
    #[test]
    fn order_ids_in_paths_are_strings_of_the_same_pattern_as_in_bodies() {
        let doc = document();
        let in_bodies = &doc["components"]["schemas"]["OrderResponse"]["properties"]["order_id"];
        assert_eq!(in_bodies["pattern"], "^[1-9][0-9]{0,18}$");
        let mut seen = 0;
        for (method, path, op) in operations(&doc) {
            for param in op["parameters"].as_array().into_iter().flatten() {
                if param["name"] != "order_id" {
                    continue;
                }
                seen += 1;
                assert_eq!(param["in"], "path", "{method} {path}");
                assert_eq!(param["schema"]["type"], "string", "{method} {path}");
                assert_eq!(
                    param["schema"]["pattern"], in_bodies["pattern"],
                    "{method} {path}"
                );
                assert!(param["schema"].get("format").is_none(), "{method} {path}");
            }
        }
        assert_eq!(
            seen, 6,
            "get, checkout, pay, redeem, refund and cancel take an order id"
        );
    }

    /// A voucher's answer is one object with its terms' fields beside its own, as it
    /// is on the wire, not an `allOf` that generators split differently.
    #[test]
    fn a_shape_shared_by_flattening_is_documented_as_one_object() {
        let doc = document();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for (name, schema) in schemas {
            assert!(schema.get("allOf").is_none(), "{name} is an allOf");
        }
        let voucher = &schemas["VoucherResponse"];
        assert_eq!(voucher["type"], "object");
        for field in [
            "id",
            "shop_id",
            "title",
            "pay_value",
            "refundable",
            "created_at",
        ] {
            assert!(voucher["properties"].get(field).is_some(), "{field}");
            assert!(
                voucher["required"]
                    .as_array()
                    .unwrap()
                    .contains(&field.into()),
                "{field}"
            );
        }
    }

    /// Mainstream generators read the document alike: no property carries a schema
    /// `default` (openapi-typescript makes such a property required, so a request body
    /// that leaves a defaulted field out would not type-check), fields always sent are
    /// required (`null` when they do not apply), and the fixed words are enums.
    #[test]
    fn generated_clients_agree_on_what_is_optional_and_what_is_fixed() {
        let doc = document();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for (name, schema) in schemas {
            for (field, property) in schema["properties"].as_object().into_iter().flatten() {
                assert!(
                    property.get("default").is_none(),
                    "{name}.{field} has a default"
                );
            }
        }
        let required = |name: &str| -> Vec<String> {
            serde_json::from_value(schemas[name]["required"].clone()).unwrap()
        };
        for name in ["OrderResponse", "PaymentView"] {
            let fields = schemas[name]["properties"].as_object().unwrap();
            let mut all: Vec<String> = fields.keys().cloned().collect();
            let mut listed = required(name);
            all.sort();
            listed.sort();
            assert_eq!(listed, all, "{name}: every field is always sent");
        }
        assert!(!required("CreateSeckill").contains(&"pay_within_secs".to_string()));
        assert!(!required("CreateSeckill").contains(&"segments".to_string()));
        assert_eq!(
            schemas["Admitted"]["properties"]["status"]["enum"],
            serde_json::json!(["pending"])
        );
        assert_eq!(
            schemas["GrabOutcome"]["enum"],
            serde_json::json!(["unknown"])
        );
    }

    /// `code` is an enum of every code the service answers, from the one Rust enum the
    /// error mapping uses.
    #[test]
    fn the_error_code_is_an_enum_of_every_code_the_service_answers() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        assert_eq!(
            schemas["ErrorDetail"]["properties"]["code"]["$ref"],
            "#/components/schemas/ErrorCode"
        );
        assert_eq!(
            schemas["ErrorCode"]["enum"],
            serde_json::json!([
                "unauthorized",
                "forbidden",
                "not_found",
                "validation",
                "not_started",
                "ended",
                "sold_out",
                "already_ordered",
                "order_pending",
                "order_paid",
                "order_closed",
                "order_used",
                "order_unpaid",
                "not_refundable",
                "rate_limited",
                "unavailable",
                "conflict",
                "internal",
                "bad_signature",
                "id_conflict"
            ])
        );
        assert_eq!(
            schemas["ErrorCode"]["enum"],
            serde_json::to_value(ErrorCode::ALL).unwrap()
        );
    }

    /// The answers of the server's own limits are described where they can happen, in
    /// the JSON error format: 413 on the operations that read a body, 414 (the URL) and
    /// 431 (the head) on every operation, 405 (another method on the path) on every one.
    #[test]
    fn the_limits_answers_are_documented_where_they_can_occur() {
        let doc = document();
        let error_body = serde_json::json!({"$ref": "#/components/schemas/ErrorBody"});
        let ops = operations(&doc);
        assert_eq!(ops.len(), 24);
        for (method, path, op) in ops {
            let has_body = op.get("requestBody").is_some();
            for status in ["405", "413", "414", "431"] {
                let response = &op["responses"][status];
                if status == "413" && !has_body {
                    assert!(
                        response.is_null(),
                        "{method} {path} reads no body: {status}"
                    );
                    continue;
                }
                assert_eq!(
                    response["content"]["application/json"]["schema"], error_body,
                    "{method} {path} {status}: {response}"
                );
            }
        }
    }

    #[tokio::test]
    async fn the_docs_page_loads_nothing_from_elsewhere() {
        let page = docs().await.0;
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "{page}"
        );
        for asset in ["swagger-ui.css", "swagger-ui-bundle.js"] {
            assert!(page.contains(&format!("/docs/{asset}")));
            let response = docs_asset(Ok(axum::extract::Path(asset.to_string()))).await;
            assert_eq!(response.status(), 200, "{asset}");
            let body = axum::body::to_bytes(response.into_body(), 10 << 20)
                .await
                .unwrap();
            assert!(body.len() > 10_000, "{asset}: {} bytes", body.len());
        }
        let other = docs_asset(Ok(axum::extract::Path("index.html".into()))).await;
        assert_eq!(other.status(), 404);
    }
}
